"""The torch.distributed backend "lockstep" with real processes (docs/torch.md): a job
written for gloo (tcp:// init, fixed ranks) against references computed here; an
elastic job (lockstep://) that admits a newcomer; a peer killed mid-collective (every
survivor raises a retryable lockstep error with its tensor unchanged, the old group
raises ViewChangedError after the update, and the next group works); bad tensors
(an exception on every peer, never a hang)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional

import pytest

torch = pytest.importorskip("torch")
if os.environ.get("LOCKSTEP_TORCH_BUILT", "ON") == "OFF":
    pytest.skip("this build left out lockstep._torch (no libtorch-dev)", allow_module_level=True)

import lockstep  # noqa: E402
import lockstep.torch  # noqa: E402,F401  (the module must import in a build that has it)

from torch_worker import DTYPES, contribution  # noqa: E402

TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))
WAIT_S = 60 * TIME_SCALE
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_worker.py")


class Worker:
    """One torch process; JSON lines both ways."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None, script: str = WORKER) -> None:
        self.proc = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def read(self, timeout: float = WAIT_S) -> Dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.proc.pid}: no answer within {timeout} s") from None
        if not line:
            raise AssertionError(f"worker {self.proc.pid} ended (exit {self.proc.wait()})")
        answer = json.loads(line)
        assert "exception" not in answer, answer.get("trace")
        return answer

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def send_line(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd: Any) -> Dict[str, Any]:
        self.send(**cmd)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def ask_all(workers: List[Worker], **cmd: Any) -> List[Dict[str, Any]]:
    for w in workers:
        w.send(**cmd)
    return [w.read() for w in workers]


def free_port() -> int:
    """A free port for torch's store, outside the band lockstep's default ports take
    (48149 upwards, bump-allocated by the peers of tests that run meanwhile: one of them
    once took the port between this choice and the store's bind)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not 48100 <= port < 49200:
            return port


@pytest.fixture
def workers():
    started: List[Worker] = []
    yield started
    for w in started:
        w.close()


def check_ready(w: Worker, rank: int, world: int) -> int:
    ready = w.read()
    view_rank = ready.pop("view_rank")
    assert ready == {"ready": True, "rank": rank, "world": world, "backend": "lockstep"}
    return view_rank


def start_fixed(workers: List[Worker], world: int) -> List[Worker]:
    """A job as gloo's users launch it: rank 0 hosts the lockstep master."""
    url = f"tcp://127.0.0.1:{free_port()}"
    new = [Worker("fixed", url, str(r), str(world)) for r in range(world)]
    workers.extend(new)
    for r, w in enumerate(new):
        check_ready(w, r, world)
    return new


def peers_in_phase(master: lockstep.Master, phase: str) -> int:
    with urllib.request.urlopen(f"http://{master.http_address}/api/state", timeout=10) as r:
        return sum(1 for p in json.load(r)["peers"] if p["phase"] == phase)


def start_fixed_in_order(workers: List[Worker], master: lockstep.Master, order: List[int], store: str) -> List[Worker]:
    """A fixed-size job on a master of its own (LOCKSTEP_MASTER), its ranks admitted in
    `order`, so that lockstep's ring order (the view's ranks) differs from torch's. Its
    store is a file (file://): tcp://'s rank 0 waits for every rank before any goes on."""
    url = f"file://{store}"
    world = len(order)
    by_rank: Dict[int, Worker] = {}
    for i, r in enumerate(order):
        by_rank[r] = Worker("fixed", url, str(r), str(world), env={"LOCKSTEP_MASTER": master.address})
        workers.append(by_rank[r])
        deadline = time.monotonic() + WAIT_S
        while peers_in_phase(master, "ACCEPTED") < i + 1:
            assert time.monotonic() < deadline, f"rank {r} was not admitted"
            time.sleep(0.05)
    view_ranks = [check_ready(by_rank[r], r, world) for r in range(world)]
    assert view_ranks != list(range(world)), "the ring order should differ from torch's ranks here"
    return [by_rank[r] for r in range(world)]


def start_elastic(workers: List[Worker], master: lockstep.Master, count: int) -> List[Worker]:
    """The first is accepted alone; each next one is admitted by those already in."""
    url = f"lockstep://127.0.0.1:{master.port}"
    new: List[Worker] = []
    for i in range(count):
        w = Worker("elastic", url)
        workers.append(w)
        if new:
            for answer in ask_all(new, cmd="admit"):
                assert answer == {"world": i + 1}
            ask_all(new, cmd="reconfigure")
        ready = w.read()
        assert ready["ready"] and ready["world"] == i + 1
        new.append(w)
    return new


def expected_collectives(world: int) -> Dict[str, Any]:
    """The references, from the workers' inputs."""
    exp: Dict[str, Any] = {}
    for dtype in DTYPES:
        inputs = [contribution(r, 7, dtype).double() for r in range(world)]
        stacked = torch.stack(inputs)
        ops = {"sum": stacked.sum(0), "max": stacked.max(0).values, "min": stacked.min(0).values,
               "product": stacked.prod(0), "avg": stacked.sum(0) / world}
        for op in (["sum", "avg", "max", "min", "product"] if dtype == "float32" else ["sum", "max"]):
            exp[f"all_reduce/{dtype}/{op}"] = ops[op].tolist()
    for root in range(world):
        exp[f"broadcast/{root}"] = contribution(root, 6, "float32", salt=root).tolist()
    exp["all_gather"] = [contribution(r, 4, "int64").tolist() for r in range(world)]
    exp["all_gather_base"] = torch.cat([contribution(r, 4, "float32") for r in range(world)]).tolist()
    return exp


def test_fixed_size_job_written_for_gloo_gets_every_collective_right(workers, tmp_path):
    world = 3
    with lockstep.Master("127.0.0.1:0", http="127.0.0.1:0") as master:
        procs = start_fixed_in_order(workers, master, [2, 0, 1], str(tmp_path / "store"))
        check_collectives(procs, world)
        for w in procs:
            w.close()


def check_collectives(procs: List[Worker], world: int) -> None:
    results = [a["results"] for a in ask_all(procs, cmd="collectives")]
    exp = expected_collectives(world)
    for rank, res in enumerate(results):
        for key, value in exp.items():
            if key == "all_reduce/float32/avg":
                assert res[key] == pytest.approx(value, rel=1e-6), (rank, key)
            else:
                assert res[key] == value, (rank, key)
        # reduce-scatter: torch rank r gets the sum of every rank's r-th block, in torch's rank order
        assert res["reduce_scatter"] == sum(contribution(s, 3, "float32", salt=rank) for s in range(world)).tolist()
        assert res["reduce_scatter_base"] == sum(contribution(s, 3, "float64", salt=rank)
                                                 for s in range(world)).tolist()
        assert res["async"] == [sum(contribution(s, 5, "float32", salt=k) for s in range(world)).tolist()
                                for k in range(4)]
        assert res["future"] == sum(contribution(s, 2, "float64") for s in range(world)).tolist()
    # Every rank holds the same bits.
    for key in exp:
        assert len({json.dumps(r[key]) for r in results}) == 1, key


def test_bad_tensors_raise_on_every_peer_and_the_group_goes_on(workers):
    procs = start_fixed(workers, 2)
    for kind, message in (("non_contiguous", "not contiguous"), ("requires_grad", "requires grad"),
                          ("bool", "dtype Bool")):
        # Both bad: both get the local error.
        for answer in ask_all(procs, cmd="bad", kind=kind):
            assert answer["error"] == "InvalidArgumentError", (kind, answer)
            assert message in answer["message"], (kind, answer)
        # One bad: it gets its error, the other an exception too (not a hang).
        procs[0].send(cmd="bad", kind=kind)
        procs[1].send(cmd="bad", kind="good")
        first, second = procs[0].read(), procs[1].read()
        assert first["error"] == "InvalidArgumentError" and message in first["message"], (kind, first)
        assert second["error"] == "OperationMismatchError", (kind, second)
    # Shapes that differ between peers.
    procs[0].send(cmd="bad", kind="longer")
    procs[1].send(cmd="bad", kind="good")
    assert [p.read()["error"] for p in procs] == ["OperationMismatchError"] * 2
    for answer in ask_all(procs, cmd="bad", kind="good"):
        assert answer == {"ok": True, "value": [2.0] * 8}


def test_elastic_job_admits_a_newcomer_and_a_killed_peer_leaves_a_working_group(workers):
    with lockstep.Master("127.0.0.1:0") as master:
        procs = start_elastic(workers, master, 3)
        answers = ask_all(procs, cmd="sum")
        assert sorted(a["rank"] for a in answers) == [0, 1, 2]
        assert {a["value"] for a in answers} == {6.0} and {a["world"] for a in answers} == {3}

        for p in procs:
            p.send(cmd="loop")
        for p in procs:
            assert p.read() == {"looping": True}
        victim, survivors = procs[1], [procs[0], procs[2]]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        # One outcome for both survivors. Killed during a collective: a retryable error,
        # the tensor as before the call. Killed between two, so that the master drops it
        # before the next one's vote: that all-reduce goes on with the two survivors, which
        # a torch group of three refuses (ViewChangedError, the tensor holding their sum).
        answers = [p.read() for p in survivors]
        assert len({a["error"] for a in answers}) == 1, answers
        for answer in answers:
            if answer["error"] == "PeerConnectionLostError":
                assert answer["retryable"], answer
                assert answer["unchanged"], "the tensor of a failed all-reduce must be as before the call"
            else:
                assert answer["error"] == "ViewChangedError" and not answer["retryable"], answer
        # Before the update, lockstep would reduce over the two survivors: the torch group
        # of three refuses the result (every survivor sees the same count).
        assert [a["error"] for a in ask_all(survivors, cmd="stale")] == ["ViewChangedError"] * 2
        for answer in ask_all(survivors, cmd="update"):
            assert answer == {"world": 2}
        # The old group belongs to the old view.
        assert [p.ask(cmd="stale")["error"] for p in survivors] == ["ViewChangedError"] * 2
        for answer in ask_all(survivors, cmd="reconfigure"):
            assert answer["world"] == 2
        answers = ask_all(survivors, cmd="sum")
        assert {a["value"] for a in answers} == {3.0} and sorted(a["rank"] for a in answers) == [0, 1]


# ------------------------------------------------------------ fault-tolerant DDP

DDP_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_ddp_worker.py")


def DdpWorker(*args: str, env: Optional[Dict[str, str]] = None) -> Worker:
    return Worker(*args, script=DDP_WORKER, env=env)


def run_fixed_ddp(workers: List[Worker], world: int, steps: int,
                  env_of: Any = lambda rank: None) -> List[Dict[str, Any]]:
    """A fixed-size DDP job that nobody leaves: every step commits. Each worker's lines,
    the last one its final parameters."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [DdpWorker("fixed", url, str(r), str(world), str(steps), env=env_of(r)) for r in range(world)]
    workers.extend(procs)
    lines: List[List[Dict[str, Any]]] = []
    for w in procs:
        assert w.read() == {"ready": True}
        got: List[Dict[str, Any]] = []
        while not got or "done" not in got[-1]:
            got.append(w.read())
            if "step" in got[-1]:
                assert got[-1]["committed"], got[-1]  # nobody dies: every step commits
        lines.append(got)
    for w in procs:
        w.close()
    return lines


def one_process_reference(steps: int) -> List[Any]:
    from torch_ddp_worker import global_batch, make_model

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(steps):
        x, y = global_batch(s)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().double().flatten() for p in model.parameters()]


def assert_params_match(finals: List[Dict[str, Any]], reference: List[Any]) -> None:
    for final in finals:
        for got, want in zip(final["params"], reference):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-4, atol=1e-6)
    assert all(f["params"] == finals[0]["params"] for f in finals)  # bit for bit


def test_elastic_url_inbound_0_joins_as_a_peer_behind_a_nat(workers):
    """?inbound=0 makes the process a peer that accepts no inbound connection (it listens
    on no port; the master's view shows its ports as 0); the group's collectives run."""
    with lockstep.Master("127.0.0.1:0", http="127.0.0.1:0") as master:
        url = f"lockstep://127.0.0.1:{master.port}"
        first = Worker("elastic", url)
        workers.append(first)
        ready = first.read()
        assert ready["ready"] and ready["world"] == 1
        wait_for(lambda: peers_in_phase(master, "ACCEPTED") == 1, "the first peer was not accepted")
        hidden = Worker("elastic", url + "?inbound=0")
        workers.append(hidden)
        wait_for(lambda: peers_in_phase(master, "REGISTERED") == 1, "the second did not register")
        assert ask_all([first], cmd="admit") == [{"world": 2}]
        ask_all([first], cmd="reconfigure")
        ready = hidden.read()
        assert ready["ready"] and ready["world"] == 2
        with urllib.request.urlopen(f"http://{master.http_address}/api/state", timeout=10) as r:
            ports = sorted(p["p2p_port"] == 0 for p in json.load(r)["peers"])
        assert ports == [False, True], ports
        answers = ask_all([first, hidden], cmd="sum")
        assert {a["value"] for a in answers} == {3.0} and {a["world"] for a in answers} == {2}
    with pytest.raises(lockstep.InvalidArgumentError, match="inbound must be"):
        next(lockstep.torch._rendezvous("lockstep://127.0.0.1:1?inbound=maybe"))


def test_fault_tolerant_ddp_matches_one_process_on_the_same_global_batches(workers):
    steps, world = 50, 3
    finals = [lines[-1] for lines in run_fixed_ddp(workers, world, steps)]
    for final in finals:
        assert final["committed"] == steps and final["skipped"] == 0
    assert_params_match(finals, one_process_reference(steps))


def test_uneven_batches_weighted_by_batch_match_one_process(workers):
    """weight_by_batch: ranks holding 8 and 4 of each global batch of 12 train as one
    process on the whole batch (a mean over every sample, not over the ranks' means)."""
    steps = 20
    finals = [lines[-1] for lines in run_fixed_ddp(workers, 2, steps, lambda r: {"LOCKSTEP_TEST_UNEVEN": "1"})]
    assert_params_match(finals, one_process_reference(steps))


def test_a_run_restarted_from_its_checkpoints_goes_on_as_if_never_stopped(workers, tmp_path):
    """Two peers train 6 steps and checkpoint (TrainingState.state_dict: model, Adam's
    moments and step counts, the data position, the revision); a new run of two peers
    resumes from those files and trains to 12: the parameters are those of 12 steps in
    one process, and the resumed peers present the checkpoint's revision."""
    world = 2
    ckpt = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    run_fixed_ddp(workers, world, 6, lambda r: {"LOCKSTEP_TEST_CHECKPOINT": ckpt[r]})
    saved = [torch.load(c) for c in ckpt]
    assert saved[0]["revision"] == saved[1]["revision"] > 0
    assert int(saved[0]["extra"]["step"]) == 6
    resumed = run_fixed_ddp(workers, world, 12, lambda r: {"LOCKSTEP_TEST_RESUME": ckpt[r]})
    for lines in resumed:
        first = next(line for line in lines if "begin" in line)
        # The data position came back, and the first sync advanced the checkpoint's revision.
        assert first["begin"] == 6 and first["revision"] == saved[0]["revision"] + 1, first
        assert lines[-1]["committed"] == 6
    assert_params_match([lines[-1] for lines in resumed], one_process_reference(12))


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_fault_tolerant_ddp_through_a_kill_and_a_join_keeps_every_peer_identical(workers):
    """The test drives the steps ("go" to every live peer, one step line back from each):
    a peer is SIGKILLed right after a go, a newcomer joins once it is registered."""
    with lockstep.Master("127.0.0.1:0", http="127.0.0.1:0") as master:
        url = f"lockstep://127.0.0.1:{master.port}"
        begins: Dict[int, set] = {}
        afters: Dict[int, set] = {}

        def start() -> Worker:
            w = DdpWorker("elastic", url, "-", "-", "0")
            workers.append(w)
            return w

        live = [start()]
        wait_for(lambda: peers_in_phase(master, "ACCEPTED") == 1, "the first peer was not accepted")
        live += [start(), start()]
        wait_for(lambda: peers_in_phase(master, "REGISTERED") == 2, "the others did not register")
        victim, newcomer = live[1], None
        worlds: List[int] = []
        for round_ in range(30):
            if round_ == 16:
                newcomer = start()
                wait_for(lambda: peers_in_phase(master, "REGISTERED") == 1, "the newcomer did not register")
                live.append(newcomer)
            for w in live:
                w.send_line("go")
            if round_ == 8:
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
                live.remove(victim)
            for w in live:
                while True:
                    line = w.read()
                    if "ready" in line:
                        continue
                    if "begin" in line:
                        begins.setdefault(line["begin"], set()).add(line["hash"])
                        if not worlds or worlds[-1] != line["world"]:
                            worlds.append(line["world"])
                        if w is newcomer and not hasattr(w, "first_begin"):
                            w.first_begin = line  # type: ignore[attr-defined]
                    elif "step" in line:
                        if line["committed"]:
                            afters.setdefault(line["step"], set()).add(line["hash"])
                        break
        for step, hashes in list(begins.items()) + list(afters.items()):
            assert len(hashes) == 1, f"peers differ at step {step}: {hashes}"
        # The newcomer's state after its join equals the group's at that step, bit for bit.
        first = newcomer.first_begin  # type: ignore[attr-defined]
        assert first["world"] == 3 and begins[first["begin"]] == {first["hash"]}
        # The survivors went on as two (the kill cost the step in flight, or was seen in
        # the membership vote before it), then as three with the newcomer.
        assert 2 in worlds and worlds[-1] == 3, worlds
        assert max(afters) >= 25, f"too few steps committed: {max(afters)}"
        for w in live:
            w.close()
