"""How the agent drains an engine before stopping it (`drain_shard`): it waits for the engine's /metrics to say,
twice in a row, that nothing runs or waits; an engine slow to answer is asked again rather than killed; one
with no metrics, not listening, or not yet serving is stopped at once. The engine here is a real process (its kill is what is watched) whose
/metrics is a real HTTP server answering a script of readings."""

import http.server
import subprocess
import threading
import time

import pytest

from llmgw.node.supervisor import Shard, Supervisor
from llmgw.procs import free_port, wait_for

BUSY = "vllm:num_requests_running 1.0\nvllm:num_requests_waiting 0.0\n"
QUEUED = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 2.0\n"
IDLE = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
SLOW = "slow"  # answers only once the agent, done waiting, asks again: a CPU too busy to answer in time
MISSING = "missing"  # a 404: an engine with no metrics


class Metrics(http.server.ThreadingHTTPServer):
    """Answers /metrics with each of SCRIPT in turn (its last from then on), noting when each was asked."""

    def __init__(self, script: list[str]):
        self.script, self.asked, self.answered = script, [], []
        self.asked_again = threading.Event()  # set at each reading: the slow one waits for the next

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):
                reading = self.script[min(len(self.asked), len(self.script) - 1)]
                self.asked.append(time.monotonic())
                self.answered.append(reading)
                self.asked_again.set()
                if reading == SLOW:
                    self.asked_again.clear()
                    self.asked_again.wait(60)  # past the agent's wait, whatever the machine's load
                    reading = BUSY
                if reading == MISSING:
                    handler.send_error(404)
                    return
                data = reading.encode()
                try:
                    handler.send_response(200)
                    handler.send_header("Content-Length", str(len(data)))
                    handler.end_headers()
                    handler.wfile.write(data)
                except OSError:
                    pass  # a slow answer the agent stopped waiting for

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def engine(tmp_path):
    """A supervisor holding one ready shard whose process is `sleep` and whose port is a Metrics server's."""
    made = []

    def make(script, state="ready", listening=True):
        metrics = Metrics(script)
        port = metrics.server_address[1] if listening else free_port()
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)  # the agent kills the engine's group
        supervisor = Supervisor("n1", str(tmp_path / "work"), str(tmp_path / "weights"), "127.0.0.1", "127.0.0.1",
                                report=lambda fields: None)
        shard = Shard({"shard_id": "s", "model": "m", "engine": "vllm"}, port, str(tmp_path / "s.log"), None)
        shard.proc, shard.pid, shard.state = proc, proc.pid, state
        supervisor.shards["s"] = shard
        made.append((metrics, proc))
        return supervisor, metrics, proc

    yield make
    for metrics, proc in made:
        proc.kill()
        proc.wait()
        metrics.shutdown()
        metrics.server_close()


def stopped_when(proc) -> float:
    wait_for("the engine stopped", 120, lambda: proc.poll() is not None)
    return time.monotonic()


def test_an_engine_is_stopped_only_once_two_readings_in_a_row_find_it_idle(engine):
    # Slow to answer, busy, idle once (not enough), queued, then idle from then on.
    supervisor, metrics, proc = engine([SLOW, BUSY, IDLE, QUEUED, IDLE])
    assert supervisor.stop("s", drain=60)
    stopped = stopped_when(proc)
    # Stopped by the second idle reading in a row (the sixth, unless a reading on a busy machine took longer
    # than the agent waits, which starts the count again), never by the lone idle one.
    assert metrics.answered[:5] == [SLOW, BUSY, IDLE, QUEUED, IDLE] and metrics.answered[-2:] == [IDLE, IDLE]
    assert stopped > metrics.asked[-1] and stopped - metrics.asked[0] < 50  # not by the drain's timeout
    wait_for("the shard forgotten", 60, lambda: "s" not in supervisor.shards)


def test_an_engine_with_no_metrics_is_stopped_at_once(engine):
    supervisor, metrics, proc = engine([MISSING])
    assert supervisor.stop("s", drain=120)
    stopped_when(proc)
    assert len(metrics.asked) == 1


def test_an_engine_not_listening_is_stopped_at_once(engine):
    supervisor, metrics, proc = engine([BUSY], listening=False)
    began = time.monotonic()
    assert supervisor.stop("s", drain=120)
    assert stopped_when(proc) - began < 60  # not the drain's 120 s


def test_an_engine_not_yet_serving_is_not_drained(engine):
    # Still starting: it has nothing to finish, and its GPUs are free for the next placement once it stops.
    supervisor, metrics, proc = engine([BUSY], state="starting")
    assert supervisor.stop("s", drain=120)
    stopped_when(proc)
    assert metrics.asked == []


def test_a_drain_ends_at_its_timeout_however_busy_the_engine(engine):
    supervisor, metrics, proc = engine([BUSY])
    began = time.monotonic()
    assert supervisor.stop("s", drain=3)
    stopped = stopped_when(proc)
    assert stopped - began >= 3 and len(metrics.asked) >= 2
