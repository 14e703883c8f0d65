"""The task families (src/kvtier/tasks/chains.py, issue #36): `chains`, the shipped reasoner's, stays the
same problems byte for byte; `chains-long` has 2.5k-4k-token traces with the needle's key line at least
1,500 tokens before the question (measured with the shipped reasoner's tokenizer); every command that
takes a family refuses an unknown one by name."""

import hashlib
import random
import statistics

import pytest

from kvtier.tasks import chains as rt


def _digest(problems) -> str:
    h = hashlib.sha256()
    for p in problems:
        h.update(f"{p.kind}|{p.y0}|{p.x0}|{p.n}|{p.prompt}|{p.trace}|{p.answer}\n".encode())
    return h.hexdigest()


# Pinned before the family parameter existed (commit 8638bf3's chains.py): the held-out sets the README's
# accuracies were measured on, the seeded streams, and the training script's per-step draws.
PINNED = {
    ("eval", "local"): "d244fb7fef4b9181c1442b3c5348ff6b8125c198e14a4b800ca530fea6c7be46",
    ("eval", "needle"): "98d3b989c8dfde2d7eac4d5dd463c9f4fb419ec92299e62567d518ef97da95d1",
    ("train", "local"): "ba8239c16cdd2ea619cbfcb6edd1fb9a932e19ef6b385fc0bf022ef5c8b5b782",
    ("train", "needle"): "307304723638f0c94b44da1284a17fcee404658465e9c3b15d1e2e4d2a69e2d5",
}


@pytest.mark.parametrize("split, kind", sorted(PINNED))
def test_the_shipped_family_is_unchanged(split, kind):
    got = rt.eval_problems(8, kind) if split == "eval" else rt.problems(rt.TRAIN_SEED, 8, kind)
    assert _digest(got) == PINNED[split, kind]
    fam = rt.family("chains")                                   # the same problems by name
    by_name = fam.eval_problems(8, kind) if split == "eval" else fam.problems(rt.TRAIN_SEED, 8, kind)
    assert _digest(by_name) == PINNED[split, kind]


def test_the_shipped_family_draws_the_same_training_batches():
    from kvtier.models.reasoner_data import short_problems, step_problems

    assert _digest(step_problems(16, 0, 8, set()) + step_problems(16, 123, 8, set())) == \
        "bde7d116ca4e78bbaf7c1927b244d18bc9a070766443bfa1af4a26789702146b"
    assert _digest(short_problems(16, 5, 4)) == "2711733e42e49153367ba7b9a75757dbb001722a871541693f7bc784662da3a2"
    assert _digest([rt.sample_problem(random.Random(0), k) for k in rt.KINDS]) == \
        "2984a7a59bfe57e10c997f214fceae2cfad8e7923f8bd57978a1e9b01ee85199"


# ----------------------------------------------------------------------------------------------- chains-long
def _tokenizer():
    """The shipped reasoner's tokenizer (its files), else the one that builds them."""
    from kvtier.models.reasoner import REASONER_DIR, build_reasoner_tokenizer

    if (REASONER_DIR / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(REASONER_DIR)
    return build_reasoner_tokenizer()


def _n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _key_to_question(tok, p) -> int:
    """Tokens from the key line's start to the restated question's, counted on the trace itself."""
    key_line = p.trace.index("\nk=") + 1
    question = p.trace.rindex("\n" + rt.ASK[p.kind] + "\n") + 1
    return _n_tokens(tok, p.trace[:question]) - _n_tokens(tok, p.trace[:key_line])


def test_long_family_traces_are_2_5k_to_4k_tokens_with_the_key_1500_before_the_question():
    tok = _tokenizer()
    fam = rt.family("chains-long")
    lengths, distances = [], []
    for kind in rt.KINDS:
        for p in fam.eval_problems(24, kind) + fam.problems(rt.TRAIN_SEED, 24, kind):
            n_tok = _n_tokens(tok, p.trace)
            assert n_tok == rt.trace_tokens(p.n, fam.key_at)              # the arithmetic the CLIs size from
            lengths.append(n_tok)
            lines = p.trace.split("\n")
            assert sum(line.startswith("k=") for line in lines) == 1         # the key is written once
            assert p.trace[p.trace.index("\nk=") + 1:].startswith(f"k={rt.show(p.key)}\n")
            assert lines[lines.index(f"k={rt.show(p.key)}") - 1].startswith(f"{fam.key_at:03d} ")
            distances.append(_key_to_question(tok, p))
            if kind == "needle":
                assert p.answer == rt.show(p.key) and p.prompt.endswith("?k\n")
    assert 2500 <= min(lengths) and max(lengths) <= 4000
    assert 2500 <= fam.min_trace_tokens and fam.max_trace_tokens <= 4000
    assert 2800 <= statistics.median(lengths) <= 3600                     # spread over the range, not at one end
    assert min(distances) >= 1500 and set(distances) == {fam.key_to_question_tokens}
    assert fam.max_tokens > fam.max_trace_tokens                           # a generation budget holds a trace
    # every line of a long trace is the recurrence's next step (the shipped family's rule)
    p = fam.eval_problems(1, "local")[0]
    lines = [line for line in p.trace.split("\n") if line[:1].isdigit()]
    for prev, line in zip(lines, lines[1:]):
        y, x = int(prev[5] + prev[4]), int(prev[8] + prev[7])
        assert line[4:] == f"{rt.show(x)} {rt.show((y + x) % 100)}" and int(line[:3]) == int(prev[:3]) - 1


def test_families_are_chosen_by_name_and_draw_their_own_problems():
    assert rt.family("chains") is rt.CHAINS and rt.DEFAULT_FAMILY == "chains"
    long = rt.family("chains-long")
    assert long.eval_problems(4, "local") == long.eval_problems(4, "local")
    assert {(p.y0, p.x0) for p in long.eval_problems(8, "local")} != {(p.y0, p.x0) for p in rt.eval_problems(8, "local")}
    assert all(250 <= p.n <= 400 and p.key_at == long.key_at for p in long.eval_problems(16, "needle"))
    assert rt.CHAINS.max_trace_tokens == 1122 and rt.CHAINS.max_tokens == 1200   # what the CLIs' defaults say
    with pytest.raises(ValueError, match="unknown task family 'chains-short'; known: chains, chains-long, chains-mid"):
        rt.family("chains-short")
    # the length is a parameter; a needle needs its key line
    short = long.problems(0, 3, "local", n_range=(170, 180))
    assert all(170 <= p.n <= 180 for p in short)
    with pytest.raises(ValueError, match="needle needs n > 160"):
        long.problems(0, 1, "needle", n_range=(100, 200))
    with pytest.raises(ValueError, match="three-digit"):
        long.problems(0, 1, "local", n_range=(900, 1200))


def test_the_middle_family_puts_the_key_between_the_two_distances():
    """chains-mid (the long recipe's p5 bridge, training only): key 1,105 tokens before the question, between
    chains' and chains-long's, on n ranges none of the others draw, so the prompt's n says where the key goes."""
    tok = _tokenizer()
    mid = rt.family("chains-mid")
    dist = [f.key_to_question_tokens for f in (rt.CHAINS, mid, rt.CHAINS_LONG)]
    assert dist == sorted(dist) and dist[1] == 1105
    for p in mid.problems(rt.TRAIN_SEED, 8, "needle"):
        assert 170 <= p.n <= 245 and p.key_at == 110 and p.answer == rt.show(p.key)
        assert _key_to_question(tok, p) == 1105
        assert _n_tokens(tok, p.trace) == rt.trace_tokens(p.n, 110) < mid.max_tokens
    ranges = [f.n_range for f in (rt.CHAINS, mid, rt.CHAINS_LONG)]
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))


def test_training_draws_the_long_family_and_excludes_its_held_out_problems():
    from kvtier.models.reasoner_data import held_out_keys, longest_sequence, step_problems

    held = held_out_keys(family="chains-long")
    got = [p for s in range(10) for p in step_problems(rt.TRAIN_SEED, s, 8, held, "chains-long")]
    assert all(250 <= p.n <= 390 and p.key_at == 160 for p in got)
    assert not {(p.kind, p.y0, p.x0, p.n) for p in got} & held
    assert longest_sequence(rt.CHAINS) <= 2048 < longest_sequence(rt.CHAINS_LONG) <= 4096


def test_long_family_rl_dataset(tmp_path):
    pd = pytest.importorskip("pandas")
    from kvtier.rollout.chains_task import write_dataset

    train, val = write_dataset(tmp_path, train=4, val=2, kinds=("local", "needle"), family="chains-long")
    va, tr = pd.read_parquet(val), pd.read_parquet(train)
    assert list(va["ability"][:2]) == ["chains-long-local", "chains-long-needle"]
    held = {p.prompt for kind in rt.KINDS for p in rt.CHAINS_LONG.eval_problems(2, kind)}
    assert {r[0]["content"] for r in va["prompt"]} == held and not held & {r[0]["content"] for r in tr["prompt"]}
    with pytest.raises(ValueError, match="known: chains, chains-long"):
        write_dataset(tmp_path, train=1, val=1, family="long")


def test_eval_and_goodput_take_the_family():
    from kvtier.benchmarks.goodput import load_tasks
    from kvtier.evaluation.reasoner_eval import ReasonerEvalConfig, _jobs
    from kvtier.evaluation.runner import make_grid

    assert (ReasonerEvalConfig().max_tokens, ReasonerEvalConfig().max_model_len) == (1200, 1536)   # unchanged
    cfg = ReasonerEvalConfig(family="chains-long", problems=2, runs=1, policies=("random",), budgets=(512,))
    assert (cfg.max_tokens, cfg.max_model_len) == (4000, 4096)
    assert (ReasonerEvalConfig().kv_cache_mb, cfg.kv_cache_mb) == (512, 2048)      # chains' pool unchanged
    assert ReasonerEvalConfig(family="chains-long", kv_cache_mb=64).kv_cache_mb == 64
    jobs = _jobs(cfg, lambda text: {"input_ids": [0] + [1] * len(text)}, make_grid(cfg.policies, cfg.budgets))
    prompts = {j["problem"].question for j, _ in jobs}
    assert prompts == {p.prompt for k in rt.KINDS for p in rt.CHAINS_LONG.eval_problems(2, k)}
    with pytest.raises(ValueError, match="unknown task family"):
        ReasonerEvalConfig(family="nope")
    tasks = load_tasks("reasoner", 2, "chains-long")
    assert [t.prompt for t in tasks][:2] == [rt.CHAINS_LONG.eval_problems(1, k)[0].prompt for k in rt.KINDS]
    assert [t.prompt for t in load_tasks("reasoner", 2)] == [t.prompt for t in load_tasks("reasoner", 2, "chains")]
    # goodput's `auto` pool: 4 full traces of the family's (chains' unchanged; chains-long's: the long shapes' positions)
    from kvtier.benchmarks.goodput_cli import trace_tokens
    from kvtier.models.reasoner_data import longest_sequence

    assert trace_tokens(None) == trace_tokens("chains") == 1024
    from kvtier.models.reasoner import reasoner_config

    assert longest_sequence(rt.CHAINS_LONG) <= trace_tokens("chains-long") == reasoner_config("long-8kv").max_position_embeddings


def test_bench_rl_evaluates_and_trains_on_its_family(monkeypatch, tmp_path):
    import subprocess

    from kvtier.benchmarks import rl, rl_heldout

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(rl_heldout.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        rl.heldout_accuracy("m", rl.RLBenchShape(family="chains-long"), tmp_path)
    assert seen[0][seen[0].index("--family") + 1] == "chains-long"
    with pytest.raises(ValueError, match="unknown task family"):
        rl.run_rl_bench("m", rl.RLBenchShape(family="nope"), ["full"], tmp_path / "w")
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------------------- CLIs
def _invoke(args):
    from typer.testing import CliRunner

    from kvtier.cli import app

    r = CliRunner().invoke(app, args)
    return r.exit_code, " ".join(r.output.replace("│", " ").split())      # unwrap rich's box


@pytest.mark.parametrize("args, option", [
    (["model", "train-reasoner", "--family", "nope"], "--family"),
    (["eval", "reasoner", "--family", "nope"], "--family"),
    (["bench", "goodput", "--family", "nope"], "--family"),
    (["bench", "rl", "--family", "nope"], "--family"),
    (["rl", "smoke", "--task", "nope"], "--task"),
])
def test_an_unknown_family_is_refused_by_name(args, option, tmp_path):
    code, out = _invoke(args + ["--workdir" if args[0] in ("bench", "rl") else "--out", str(tmp_path / "w")])
    assert code == 2 and option in out and "'nope'" in out and "chains, chains-long" in out, out
    assert not (tmp_path / "w").exists()


def test_cli_refusals_before_any_engine(tmp_path):
    # the shipped reasoner has 2,048 positions: chains-long is refused before an engine starts
    from kvtier.models.reasoner import REASONER_DIR

    if (REASONER_DIR / "config.json").exists():
        code, out = _invoke(["eval", "reasoner", "--family", "chains-long", "--out", str(tmp_path / "e")])
        assert code == 2 and "--family" in out and "max_position_embeddings 2048" in out, out
        assert not (tmp_path / "e").exists()
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "p", "answer": "1"}\n')
    code, out = _invoke(["bench", "goodput", "--tasks", str(f), "--family", "chains-long",
                         "--workdir", str(tmp_path / "g")])
    assert code == 2 and "--family" in out and "JSONL" in out, out


@pytest.mark.parametrize("name", ["chains", "chains-long"])
def test_the_selection_set_never_holds_a_held_out_problem(name):
    """#59: settings (an RL budget, a temperature) are chosen on a set disjoint from every held-out read (the
    first SELECTION_EXCLUDES held-out problems), drawn the same way each time."""
    fam = rt.family(name)
    for kind in rt.KINDS:
        chosen = fam.selection_problems(64, kind)
        held = {(p.y0, p.x0, p.n) for p in fam.eval_problems(rt.SELECTION_EXCLUDES, kind)}
        assert len(chosen) == 64 and not {(p.y0, p.x0, p.n) for p in chosen} & held
        assert _digest(chosen) == _digest(fam.selection_problems(64, kind))
        assert _digest(chosen[:8]) == _digest(fam.selection_problems(8, kind))     # a prefix of one sequence


def test_eval_reasoner_draws_the_split_it_is_given():
    from kvtier.evaluation.reasoner_eval import ReasonerEvalConfig, _jobs
    from kvtier.evaluation.runner import make_grid

    class Tok:
        def __call__(self, text):
            return {"input_ids": [0, *range(len(text))]}

    cells = make_grid(("random",), (512,))
    for split, draw in (("heldout", rt.CHAINS_LONG.eval_problems), ("selection", rt.CHAINS_LONG.selection_problems)):
        cfg = ReasonerEvalConfig(problems=3, runs=1, kinds=("local",), family="chains-long", split=split)
        prompts = [job["problem"].question for job, _ in _jobs(cfg, Tok(), cells)]
        assert prompts == [p.prompt for p in draw(3, "local") for _ in cells]
    with pytest.raises(ValueError, match="split must be one of"):
        ReasonerEvalConfig(split="train")
