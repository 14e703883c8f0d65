"""A benchmark stopped by SIGTERM exits 128 + 15 after its cleanup, whatever the library code the stop
passed through did with it (the CI run of 2026-12-04 saw `kvtier bench goodput` exit 1 instead)."""

import signal

import pytest

from kvtier.benchmarks.servers import stop_servers_on_signals


def test_a_signal_stops_the_body_and_runs_its_cleanup():
    cleaned = []
    with pytest.raises(SystemExit) as exc:
        with stop_servers_on_signals():
            try:
                signal.raise_signal(signal.SIGTERM)
                pytest.fail("the body went on after SIGTERM")
            finally:
                cleaned.append(True)
    assert exc.value.code == 128 + signal.SIGTERM and cleaned == [True]


def test_a_stop_some_library_swallowed_still_stops_the_command():
    with pytest.raises(SystemExit) as exc:
        with stop_servers_on_signals():
            try:
                signal.raise_signal(signal.SIGTERM)
            except BaseException:           # a bare `except:` in library code
                pass
    assert exc.value.code == 128 + signal.SIGTERM


def test_an_exception_raised_in_place_of_the_stop_exits_as_the_signal(capsys):
    with pytest.raises(SystemExit) as exc:
        with stop_servers_on_signals():
            try:
                signal.raise_signal(signal.SIGINT)
            except SystemExit:
                raise RuntimeError("event loop is closed") from None
    assert exc.value.code == 128 + signal.SIGINT
    assert isinstance(exc.value.__cause__, RuntimeError)
    assert "RuntimeError raised while stopping: event loop is closed" in capsys.readouterr().err


def test_without_a_signal_errors_pass_through_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(ValueError):
        with stop_servers_on_signals():
            raise ValueError("not a stop")
    with stop_servers_on_signals():
        pass
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
