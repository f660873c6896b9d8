"""Workers forked from the launcher's forkserver start as spawned ones would: with the
launcher's environment as at the launch, its directory and path; a launch whose imports
would read a different environment gets a fresh server. (The launches themselves are in
tests/test_dist.py, tests/test_preemption.py and tests/test_interrupt.py.)"""

from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import pytest

from echelon3.distributed import forkserver, launch


def _report(queue, names):
    queue.put(({name: os.environ.get(name) for name in names}, os.getcwd()))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(forkserver, "PRELOAD", ())  # what it imports is not the point here
    monkeypatch.setenv("ECHELON3_TEST_GONE", "at the server's start")
    server = forkserver._server()
    forkserver.stop()  # another test's, if any (tests/reliability/kill.py)
    forkserver._started = None
    monkeypatch.setattr(server, "_preload_modules", server._preload_modules)
    assert forkserver.start_method([]) == "forkserver"
    yield forkserver.server_pid()
    forkserver.stop()
    forkserver._started = None


def test_a_worker_takes_the_environment_the_launcher_has_at_the_launch(server, monkeypatch):
    monkeypatch.setenv("ECHELON3_TEST_SET", "after the server started")
    monkeypatch.delenv("ECHELON3_TEST_GONE")
    names = ["ECHELON3_TEST_SET", "ECHELON3_TEST_GONE"]
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    worker = context.Process(target=forkserver.forked,
                             args=(_report, forkserver.environment_since(), queue, names))
    worker.start()
    seen, cwd = queue.get(timeout=60)
    worker.join(60)
    assert worker.exitcode == 0
    assert seen == {"ECHELON3_TEST_SET": "after the server started", "ECHELON3_TEST_GONE": None}
    assert cwd == os.getcwd()
    assert forkserver.server_pid() == server  # what no import reads keeps the server


def test_an_import_time_variable_or_another_directory_replaces_the_server(server, monkeypatch,
                                                                          tmp_path):
    assert forkserver.start_method([]) == "forkserver" and forkserver.server_pid() == server
    monkeypatch.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1))
    forkserver.start_method([])
    replaced = forkserver.server_pid()
    assert replaced not in (None, server)
    monkeypatch.chdir(tmp_path)
    forkserver.start_method([])
    assert forkserver.server_pid() not in (None, server, replaced)


def test_a_forked_child_of_the_launcher_does_not_hold_up_a_new_server(server, monkeypatch):
    import time

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()  # holds a copy of the server's pipe, so the server never sees it close
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        started = time.monotonic()
        forkserver.start_method([])
        assert forkserver.server_pid() not in (None, server)
        assert time.monotonic() - started < 10
    finally:
        child.kill()
        child.join()


def test_only_torch_and_echelon3_modules_are_imported_by_the_server():
    preload = forkserver.preload_for(["echelon3.tasks.train", "echelon3.warm.client",
                                      "my_models", "echelon3.__main__"])
    assert "echelon3.tasks.train" in preload and "torch" in preload
    assert not {"my_models", "echelon3.warm.client", "echelon3.__main__"} & set(preload)


def test_a_rank_that_left_no_line_is_named_with_the_oom_hint():
    lost = SimpleNamespace(exitcode=launch.PEER_LOST_EXIT, pid=11)
    message, code = launch._describe_failures(SimpleNamespace(failures={0: lost}), None,
                                              {}, nproc=2)
    assert code == 1
    assert message.startswith("rank 0 (pid 11) lost its peers; rank 1 stopped first")
    assert "OOM-killer" in message and "num_workers" in message


def test_ranks_that_exit_after_the_one_elastic_names_keep_their_own_exit_code():
    # every rank stopped on the same user error (exit 2); elastic names only the first
    first = SimpleNamespace(exitcode=2, pid=11)
    line = "error: a NaN in the loss (trainer.config.nan_policy: stop)"
    said = {0: (2, line), 1: (2, line)}
    assert launch._describe_failures(SimpleNamespace(failures={0: first}), None, said,
                                     nproc=2) == (line, 2)
    said[1] = (1, "error: net: ValueError: boom")  # a component raised on rank 1
    message, code = launch._describe_failures(SimpleNamespace(failures={0: first}), None,
                                              said, nproc=2)
    assert code == 1 and message.splitlines() == ["error: net: ValueError: boom", line]
