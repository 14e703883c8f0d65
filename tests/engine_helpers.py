"""Helpers shared by engine tests: replaying audit logs through the transformers oracle."""

from kvtier.evaluation.engine_check.checks import CONTROL_MIN, TOLERANCE, first_round_row, request_records
from kvtier.evaluation.engine_check.checks import sampled_logprobs as engine_logprobs  # noqa: F401 (tests import it)

# the engine tests' prompts: one long enough for several rounds at small budgets, two short ones
PROMPTS = [
    "Let x = 42. Then the answer is \\boxed{x} and we continue to reason about it " * 2,
    "Hello world, the answer is ",
    "A long chain of thought begins here: first we note that seven times six is forty two, ",
]


records_for = request_records   # audit records of one request (the engine check's reader)
REFERENCE_TOL = TOLERANCE["bfloat16"]   # bf16 engine vs the fp32 masked reference (the engine check's too)


def assert_matches_masked_reference(replay, out, records, buffer, *, prompt_len=None, control=True, what="",
                                    tol=REFERENCE_TOL):
    """The engine's sampled-token log-probs equal the masked reference's (transformers under the logged
    keep-sets, `kvtier.reference.MaskedReplay`) within `tol`. control: and without the masks they
    differ by more than CONTROL_MIN after the first round, so the comparison has power."""
    plen = len(out.prompt_token_ids) if prompt_len is None else prompt_len
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    eng = engine_logprobs(out)
    err = (eng - replay.logprobs(ids, plen, records, buffer)).abs()
    assert err.max() < tol, f"{what}max |engine - masked reference| = {err.max():.4f}"
    if control:
        dense = (eng - replay.logprobs(ids, plen, [], buffer)).abs()[first_round_row(records, plen):]
        assert dense.max() > CONTROL_MIN, "eviction did not change attention; the comparison proves nothing"


def greedy(max_tokens, logprobs=None, **kvtier):
    """Greedy SamplingParams with ignore_eos and the request's kvtier_* parameters."""
    from vllm import SamplingParams

    from kvtier.engine.api import sampling_extra_args

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs,
                          extra_args=sampling_extra_args(**kvtier) or None)
