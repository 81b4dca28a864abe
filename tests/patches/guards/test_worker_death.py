"""worker-death's own logic on stand-ins (no vLLM): its judgement of the executor shapes (also where
vLLM 0.33 moved the queue's check) and its error. The real vLLM runs it end to end
(tests/test_crash_resume.py)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future

import pytest


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"worker-death": "tests/test_crash_resume.py (the worker named in the error)"}

pytest.importorskip("wrapt")

from speculators_compat.services import lifecycle  # noqa: E402
from speculators_compat.errors import WorkerDiedError  # noqa: E402
from speculators_compat.core.registry import Shape  # noqa: E402
from speculators_compat.patches.features import pipelined_steps  # noqa: E402
from speculators_compat.patches.guards import worker_death  # noqa: E402
from speculators_compat.patches.guards import worker_death as death  # noqa: E402

# -- worker-death: the executor shapes ----------------------------------------------------------

MONITOR = "def start_worker_monitor(self):\n    _self.is_failed = True\n    _self.shutdown()\n"


RPC_CANCEL = "if self.is_failed:\n    raise\nmq.dequeue(timeout=t, cancel=shutdown_event)"


RPC_TIMEOUT = "if self.is_failed:\n    raise\nmq.dequeue(timeout=dequeue_timeout)"


SHUTDOWN_QUEUES = "for mq in response_mqs:\n    mq.shutdown()"


READ = "if self.shutting_down:\n    raise RuntimeError('cancelled')"


QUEUE_SHUTDOWN = "self.shutting_down = True\nself._spin_condition.cancel()"


MEMBERS = {"start_worker_monitor", "shutdown", "collective_rpc"}


GENERATOR = {"__init__", "generate"}


def judge(members=MEMBERS, generator=GENERATOR, **sources):
    base = {"start_worker_monitor": MONITOR, "shutdown": SHUTDOWN_QUEUES,
            "MessageQueue.acquire_read": READ, "MessageQueue.shutdown": QUEUE_SHUTDOWN}
    base.update(sources)
    return worker_death._judge(members, {k: v for k, v in base.items() if v is not None}, generator).shape.value


def test_worker_death_knows_both_ways_the_monitor_ends_the_wait():
    assert judge(collective_rpc=RPC_CANCEL) == "new"  # 0.11.1 - 0.17.x
    assert judge(collective_rpc=RPC_TIMEOUT) == "new"  # 0.18+
    # anything else could hang the wait, or leave no failure to see: refused
    assert judge(collective_rpc=RPC_TIMEOUT, shutdown="self.workers = []") == "unknown"
    assert judge(collective_rpc=RPC_TIMEOUT, **{"MessageQueue.acquire_read": "poll()"}) == "unknown"
    assert judge(collective_rpc=RPC_TIMEOUT, **{"MessageQueue.shutdown": None}) == "unknown"
    assert judge(collective_rpc="mq.dequeue(cancel=e)") == "unknown"  # no is_failed
    assert judge(collective_rpc=RPC_CANCEL, start_worker_monitor="_self.shutdown()") == "unknown"
    assert judge(collective_rpc=RPC_CANCEL, members={"collective_rpc"}) == "unknown"
    assert judge(collective_rpc=RPC_CANCEL, generator={"generate"}) == "unknown"


class Proc:
    def __init__(self, pid, name, exitcode=None):
        self.pid, self.name, self.exitcode = pid, name, exitcode
        self.sentinel = None

    def join(self, timeout=None):
        pass


class Worker:
    def __init__(self, rank, exitcode=None):
        self.rank = rank
        self.proc = Proc(1000 + rank, f"VllmWorker-{rank}", exitcode)


class Executor:
    def __init__(self, workers, failed=False):
        self.workers, self.is_failed, self.response_mqs = workers, failed, []


def test_the_error_names_the_dead_worker_and_chains_the_original():
    ex = Executor([Worker(0, exitcode=-15), Worker(1, exitcode=-signal.SIGKILL)], failed=True)
    with lifecycle._exits_lock:
        lifecycle._FIRST_EXITS[ex] = [ex.workers[1]]  # the watcher saw rank 1 go first
    original = RuntimeError("Worker failed with error 'Connection reset by peer'")
    with pytest.raises(WorkerDiedError) as err:
        worker_death._raise_if_dead(ex, original, "during generate()")
    text = str(err.value)
    assert "vLLM worker VllmWorker-1 (pid 1001, rank 1 of 2) was killed by SIGKILL" in text
    assert "VllmWorker-0" not in text and "during generate()" in text and "stopped its other workers" in text
    assert err.value.__cause__ is original


class MonitoredExecutor(Executor):
    """An executor whose ``is_failed`` counts how often it is read: vLLM's monitor raises the flag
    at read ``failed_at`` (None: never)."""

    def __init__(self, workers, failed_at=None):
        self.reads, self.failed_at = 0, failed_at
        super().__init__(workers)

    @property
    def is_failed(self):
        self.reads += 1
        return self.failed_at is not None and self.reads >= self.failed_at

    @is_failed.setter
    def is_failed(self, value):  # Executor.__init__'s; the flag is failed_at's
        pass


def test_an_error_relayed_before_vllm_marks_the_executor_failed_is_still_named():
    ex = MonitoredExecutor([Worker(0), Worker(1, exitcode=-signal.SIGKILL)], failed_at=3)  # a moment later
    with pytest.raises(WorkerDiedError, match=r"rank 1 of 2\) was killed by SIGKILL"):
        worker_death._raise_if_dead(ex, RuntimeError("gloo"), "during generate()")
    assert ex.reads == 3  # awaited until the flag went up, and not read again


def test_no_worker_died_no_wait_and_the_error_is_left_alone():
    ex = MonitoredExecutor([Worker(0), Worker(1)])
    assert worker_death._raise_if_dead(ex, ValueError("bad"), "during generate()") is None
    shutting = MonitoredExecutor([Worker(0, exitcode=-15)])
    shutting.shutting_down = True  # Ctrl-C: the runner stopped the workers, vLLM's flag stays down
    assert worker_death._raise_if_dead(shutting, KeyboardInterrupt(), "during generate()") is None
    assert ex.reads == shutting.reads == 1  # read once, not awaited


class PipelinedStandIn:
    """vLLM's executor as pipelined-steps sees it: steps return futures; after a worker died,
    the outstanding ones fail as vLLM's cancelled reads do."""

    def __init__(self):
        self.workers = [Worker(0), Worker(1)]
        self.is_failed = False
        self.response_mqs = []
        self.futures = []

    def _step(self, arg, non_block=False):
        fut = Future()
        self.futures.append(fut)
        return fut

    execute_model = sample_tokens = _step

    def collective_rpc(self, *args, **kwargs):
        return ["states"]


class Output:
    total_num_scheduled_tokens = 8


def test_a_death_while_replies_are_outstanding_is_named():
    real = PipelinedStandIn()
    executor = pipelined_steps.PipelinedExecutor(real)

    class Generator:
        pass

    gen = Generator()
    gen.executor = executor

    def stock_generate(token_ids):
        executor.execute_model(Output())
        executor.sample_tokens(None)
        # worker 1 is killed while both replies are outstanding; vLLM's monitor fails the executor
        real.workers[1].proc.exitcode = -signal.SIGKILL
        real.is_failed = True
        real.workers[0].proc.exitcode = -signal.SIGTERM  # stopped by vLLM's shutdown
        for fut in real.futures:
            fut.set_exception(RuntimeError("cancelled"))
        return executor.collective_rpc("_get_captured_states")  # awaits the steps first

    with pytest.raises(WorkerDiedError, match=r"VllmWorker-1 \(pid 1001, rank 1 of 2\) was killed by SIGKILL .*"
                                              r"during generate\(\)\. vLLM shut the executor down and stopped its "
                                              r"other workers.*Underlying error: RuntimeError: cancelled"):
        worker_death._generate(stock_generate, gen, ([[1, 2, 3]],), {})


def test_release_unlinks_what_the_dead_workers_made():
    from multiprocessing import shared_memory

    reply, group = (shared_memory.SharedMemory(create=True, size=64) for _ in range(2))
    untracked = f"speculators-compat-test-{os.getpid()}-cpushm_0"
    with open(f"/dev/shm/{untracked}", "wb") as fh:
        fh.write(b"x")
    ex = Executor([Worker(0, exitcode=-signal.SIGKILL), Worker(1)], failed=True)
    worker_death._NOTED[ex] = ([(ex.workers[0], reply), (ex.workers[1], None)], {group.name, untracked})
    try:
        # while a worker may still run, only the dead one's reply buffer goes
        assert worker_death.release(ex) == [reply.name]
        assert os.path.exists(f"/dev/shm/{group.name}") and os.path.exists(f"/dev/shm/{untracked}")
        ex.workers[1].proc.exitcode = -signal.SIGKILL
        assert worker_death.release(ex, all_stopped=True) == [group.name, untracked]
        assert not os.path.exists(f"/dev/shm/{group.name}") and not os.path.exists(f"/dev/shm/{untracked}")
    finally:
        for shm in (reply, group):
            shm.close()
        for name in (reply.name, group.name, untracked):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_worker_death_reads_the_queue_check_where_0_33_moved_it():
    sources = {
        "start_worker_monitor": "self.is_failed = True\n self.shutdown()",
        "collective_rpc": "if self.is_failed: raise",
        "shutdown": "for mq in self.response_mqs: mq.shutdown()",
        "MessageQueue.acquire_read": "while True:\n if not self._wait_until_readable(meta, t): continue",
        "MessageQueue.shutdown": "self.shutting_down = True",
    }
    members = {"start_worker_monitor", "shutdown", "collective_rpc"}
    assert death._judge(members, sources, {"__init__", "generate"}).shape is Shape.UNKNOWN
    sources["MessageQueue._wait_until_readable"] = "if self.shutting_down:\n    raise RuntimeError('cancelled')"
    assert death._judge(members, sources, {"__init__", "generate"}).shape is Shape.NEW
