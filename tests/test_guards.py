"""What stays of the guards' tests here: guard-output's comparison of the ids (on real tensors), and
the runner's workers leaving Ctrl-C to it. guard-input's and worker-death's own tests are
tests/patches/guards/test_guard_input.py and test_worker_death.py."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("wrapt")

from speculators_compat.services import lifecycle  # noqa: E402


def test_the_output_guard_compares_ids_as_given_and_names_a_reordered_sequence():
    torch = pytest.importorskip("torch")
    import types

    from speculators_compat.errors import CaptureContractError
    from speculators_compat.patches.guards import guard_output

    class Ids(torch.Tensor):
        def __iter__(self):
            raise AssertionError("the guard walked a token tensor element by element")

    config = types.SimpleNamespace(max_model_len=6, get_hidden_size=lambda: 4)
    generator = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=config), layer_ids=[1, 3])
    seqs = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # the second one truncated to max_model_len - 1

    def results():
        return [{"input_ids": torch.tensor(s[:5]), "hidden_states": [torch.zeros(len(s[:5]), 4)] * 2} for s in seqs]

    for given in (seqs, [torch.tensor(s).as_subclass(Ids) for s in seqs]):
        got = guard_output._generate(lambda *a: results(), generator, (given,), {})
        assert [r["input_ids"].tolist() for r in got] == [s[:5] for s in seqs]
        swapped = results()[::-1]
        with pytest.raises(CaptureContractError, match="sequence 0: input_ids do not match"):
            guard_output._generate(lambda *a: swapped, generator, (given,), {})


def _disposition_after_leaving(runner: str, queue) -> None:
    import signal

    # Python's own handler, as in a process started from a terminal (a shell's background job
    # inherits SIGINT ignored, which would pass for "left to the runner")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ["SPECULATORS_COMPAT_RUNNER"] = runner
    left = lifecycle.leave_ctrl_c_to_the_runner()
    queue.put((left, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))


@pytest.mark.parametrize("parent_is_runner", [True, False])
def test_a_worker_of_the_runner_leaves_ctrl_c_to_it(parent_is_runner):
    """A process the runner started (a vLLM worker) ignores SIGINT; any other keeps its handler,
    and so does the runner itself."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    runner = str(os.getpid()) if parent_is_runner else str(os.getpid() + 100000)
    proc = ctx.Process(target=_disposition_after_leaving, args=(runner, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=30)
    assert got == (parent_is_runner, parent_is_runner)
    before = signal.getsignal(signal.SIGINT)
    os.environ["SPECULATORS_COMPAT_RUNNER"] = str(os.getpid())
    try:
        assert lifecycle.leave_ctrl_c_to_the_runner() is False  # the runner's own process
    finally:
        del os.environ["SPECULATORS_COMPAT_RUNNER"]
    assert signal.getsignal(signal.SIGINT) is before
