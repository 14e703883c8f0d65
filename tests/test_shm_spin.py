"""vLLM's shared-memory queue readers and KVTIER_SHM_SPIN_S (engine/patch_shm.py `spin_condition_init`,
listed in engine/patches.py).

After every message a reader spins (sched_yield) for `busy_loop_s` before sleeping on the queue's socket;
on a 2-core CPU host the engine core's spin while the worker computes takes a core from the serving path.
The service sets the variable per engine where EngineConfig.shm_spin_s is set (default: vLLM's own)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvtier.engine.patches import SHM_SPIN_ENV, install

install()

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition  # noqa: E402


def _condition(is_reader: bool) -> SpinCondition:
    ctx = zmq.Context.instance()
    return SpinCondition(is_reader=is_reader, context=ctx, notify_address=f"inproc://kvtier-spin-{time.monotonic_ns()}")


def test_readers_take_the_busy_wait_from_the_environment(monkeypatch):
    monkeypatch.delenv(SHM_SPIN_ENV, raising=False)
    assert _condition(True).busy_loop_s == 1          # vLLM's own without the variable
    monkeypatch.setenv(SHM_SPIN_ENV, "0.25")
    assert _condition(True).busy_loop_s == 0.25
    assert _condition(False).busy_loop_s == 0         # a writer never waits
    explicit = SpinCondition(True, zmq.Context.instance(), "inproc://kvtier-spin-explicit", busy_loop_s=3)
    assert explicit.busy_loop_s == 3                  # a caller's own value wins


def _reader_cpu_while_waiting(monkeypatch, spin: str, wait_s: float = 1.0) -> tuple[float, float, object]:
    """A writer and a reader thread on one queue: the reader takes a first message, then waits `wait_s` for
    the second. Returns (the reader's CPU seconds during that wait, seconds from enqueue to receipt, msg)."""
    monkeypatch.setenv(SHM_SPIN_ENV, spin)
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    out: dict = {}

    def read():
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        reader.dequeue(timeout=10)
        cpu0 = time.thread_time()
        out["msg"] = reader.dequeue(timeout=10)
        out["at"], out["cpu"] = time.monotonic(), time.thread_time() - cpu0

    t = threading.Thread(target=read)
    t.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    time.sleep(wait_s)
    sent = time.monotonic()
    writer.enqueue({"second": 2})
    t.join(15)
    assert not t.is_alive()
    return out["cpu"], out["at"] - sent, out["msg"]


def test_without_spinning_a_waiting_reader_sleeps_and_still_wakes_at_once(monkeypatch):
    cpu, latency, msg = _reader_cpu_while_waiting(monkeypatch, "0")
    assert msg == {"second": 2}
    assert cpu < 0.2, f"the reader burnt {cpu:.2f} s of CPU waiting 1 s"
    assert latency < 0.1, f"the writer's notify woke the reader {latency * 1000:.0f} ms late"


def test_spinning_reader_burns_the_wait(monkeypatch):
    """The control: vLLM's behaviour (here a 10 s spin) keeps a core busy for the whole wait."""
    cpu, _, msg = _reader_cpu_while_waiting(monkeypatch, "10")
    assert msg == {"second": 2}
    assert cpu > 0.3, f"a spinning reader used only {cpu:.2f} s of CPU in 1 s"


@pytest.mark.parametrize("accelerator, shm_spin_s, expected", [
    ("cpu", None, None), ("gpu", None, None), ("gpu", 0.5, "0.5"), ("cpu", 0.0, "0.0")])
def test_engines_get_the_busy_wait_through_their_runtime_env(accelerator, shm_spin_s, expected):
    from kvtier.service.app import llm_config
    from kvtier.service.config import EngineConfig

    eng = EngineConfig(max_model_len=256, accelerator=accelerator, shm_spin_s=shm_spin_s)
    env = llm_config("e", eng, "m", "/models/m", vllm_kwargs={}).runtime_env["env_vars"]
    assert env.get(SHM_SPIN_ENV) == expected


def test_a_negative_busy_wait_is_refused_by_name():
    from pydantic import ValidationError

    from kvtier.service.config import EngineConfig

    with pytest.raises(ValidationError, match="shm_spin_s"):
        EngineConfig(max_model_len=256, shm_spin_s=-1)
