"""Facts about NIXL's Python API that the engine relies on, checked on real UCX in host memory."""

import time

import numpy as np
import pytest
import torch

from kvbridge.memory import expand_strided
from kvbridge.nixl.agent import AgentConfig, NixlAgent, NixlError


@pytest.fixture(scope="module")
def pair():
    # no NIXL progress thread: the tests drive progress themselves (the fallback path)
    a = NixlAgent("test-agent-a", AgentConfig(num_threads=1, progress_thread=False))
    b = NixlAgent("test-agent-b", AgentConfig(num_threads=1, progress_thread=False))
    yield a, b
    a.close()
    b.close()


def _wait(agent, x, peer=None, timeout=10.0):
    """Poll transfer ``x``; without progress threads the ``peer`` agent must progress too
    (it answers the connection set-up), its notifications kept for later."""
    deadline = time.monotonic() + timeout
    while (s := agent.state(x)) == "PROC":
        if peer is not None:
            peer.progress()
        if time.monotonic() > deadline:
            raise TimeoutError
    return s


def _notifs(agent, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = agent.notifications()
        if got:
            return got
        time.sleep(0.002)
    return {}


@pytest.mark.parametrize("strided", [True, False])
def test_read_with_index_arrays_and_notification(pair, strided):
    a, b = pair
    nb, bl = 32, 256
    src = torch.randint(0, 255, (nb, bl), dtype=torch.uint8)
    dst = torch.zeros((nb, bl), dtype=torch.uint8)
    a.register(np.array([[src.data_ptr(), src.numel(), 0]]))
    b.register(np.array([[dst.data_ptr(), dst.numel(), 0]]))
    name = b.add_remote(a.metadata())
    assert name == "test-agent-a"
    before = b.counts()
    rem = np.array([[src.data_ptr(), bl, 0, bl, nb]], dtype=np.uint64)
    loc = np.array([[dst.data_ptr(), bl, 0, bl, nb]], dtype=np.uint64)
    rl = b.prepare(name, rem, allow_strided=strided)
    ll = b.prepare(None, loc, allow_strided=strided)
    assert rl.num_descs == nb and rl.strided is strided
    li = np.array([0, 1, 2, 9], dtype=np.int32)
    ri = np.array([5, 6, 7, 30], dtype=np.int32)
    b.take_transfers_peak()  # the pair may have made transfers before (module fixture)
    x = b.make_transfer("READ", ll, li, rl, ri, b"done-1")
    y = b.make_transfer("READ", ll, li, rl, ri)  # never posted: the peak counts handles, not posts
    y.release()
    assert (b.take_transfers_peak(), b.take_transfers_peak()) == (2, 1)  # then from x, alive
    assert b.post(x) in ("DONE", "PROC")
    assert _wait(b, x, peer=a) == "DONE"
    tel = b.telemetry(x)
    assert tel is not None and tel.bytes == 4 * bl
    for i, j in zip(li, ri, strict=True):
        assert torch.equal(dst[i], src[j])
    assert int(dst[3].sum()) == 0
    assert _notifs(a) == {"test-agent-b": [b"done-1"]}
    b.notify(name, b"only")
    assert _notifs(a) == {"test-agent-b": [b"only"]}
    x.release()
    rl.release()
    ll.release()
    assert b.counts() == before
    b.remove_remote(name)
    assert b.counts()["remote_agents"] == 0


def test_expand_strided_matches_rows():
    arr = np.array([[100, 8, 0, 16, 3], [1000, 4, 1, 4, 2]], dtype=np.uint64)
    assert expand_strided(arr).tolist() == [[100, 8, 0], [116, 8, 0], [132, 8, 0],
                                            [1000, 4, 1], [1004, 4, 1]]


def test_errors_name_what_to_fix(pair):
    a, _ = pair
    with pytest.raises(NixlError, match="no remote agent"):
        a.prepare("nobody", np.array([[1, 1, 0]], dtype=np.uint64))
    with pytest.raises(ValueError, match="N x 3"):
        a.register(np.zeros((1, 5), dtype=np.uint64))
    with pytest.raises(ValueError):
        AgentConfig(backends=())


def test_unknown_backend_is_refused():
    with pytest.raises(NixlError, match="not available"):
        NixlAgent("test-agent-c", AgentConfig(backends=("NOPE",)))


def test_close_releases_everything():
    a = NixlAgent("test-agent-d", AgentConfig(num_threads=1))
    buf = torch.zeros(4096, dtype=torch.uint8)
    a.register(np.array([[buf.data_ptr(), 4096, 0]]))
    a.prepare(None, np.array([[buf.data_ptr(), 64, 0, 64, 64]], dtype=np.uint64))
    assert a.counts()["lists"] == 1
    a.close()
    assert a.counts() == {"registrations": 0, "lists": 0, "transfers": 0, "remote_agents": 0}
    with pytest.raises(NixlError, match="closed"):
        a.metadata()
    a.close()  # idempotent


def test_progress_keeps_notifications_for_the_next_call(pair):
    a, b = pair
    b.add_remote(a.metadata())  # idempotent for a known agent
    b.notify("test-agent-a", b"kept-1")
    b.notify("test-agent-a", b"kept-2")
    deadline = time.monotonic() + 5
    while sum(len(v) for v in a._pending.values()) < 2 and time.monotonic() < deadline:
        b.progress()  # the sender's worker pushes the messages out
        a.progress()
    got = a.notifications()
    assert got.get("test-agent-b", [])[-2:] == [b"kept-1", b"kept-2"]
    assert a.notifications() == {}  # handed out once


@pytest.mark.parametrize("delay_us", [0, 1000])
def test_native_progress_thread_serves_a_read_without_python_progress(delay_us):
    """With NIXL's progress thread (our delay), the READ's target runs no Python at all:
    no progress(), no notification check; its thread answers the connection set-up and
    the notification arrives on its own."""
    cfg = AgentConfig(num_threads=1, progress_delay_us=delay_us)
    assert cfg.progress_thread  # the default
    target, reader = NixlAgent("test-agent-t", cfg), NixlAgent("test-agent-r", cfg)
    try:
        assert target._agent.backend_options["UCX"]["num_threads"] == "1"  # init params reached UCX
        src = torch.randint(0, 255, (8, 4096), dtype=torch.uint8)
        dst = torch.zeros((8, 4096), dtype=torch.uint8)
        target.register(np.array([[src.data_ptr(), src.numel(), 0]]))
        reader.register(np.array([[dst.data_ptr(), dst.numel(), 0]]))
        name = reader.add_remote(target.metadata())
        rows = lambda t: np.array([[t.data_ptr(), 4096, 0, 4096, 8]], dtype=np.uint64)  # noqa: E731
        rl, ll = reader.prepare(name, rows(src)), reader.prepare(None, rows(dst))
        idx = np.arange(8, dtype=np.int32)
        x = reader.make_transfer("READ", ll, idx, rl, idx[::-1].copy(), b"native")
        reader.post(x)
        assert _wait(reader, x) == "DONE"  # no peer= : the target never progresses from Python
        assert torch.equal(dst, src.flip(0))
        assert _notifs(target) == {"test-agent-r": [b"native"]}
    finally:
        reader.close()
        target.close()


def test_agent_config_refuses_bad_progress_and_backend_params():
    with pytest.raises(ValueError, match="progress_delay_us"):
        AgentConfig(progress_delay_us=-1)
    with pytest.raises(ValueError, match="backend_params"):
        AgentConfig(backend_params=(("GDS", "x", "1"),))
    assert AgentConfig(num_threads=2, backend_params=(("UCX", "split_batch_size", "256"),)).init_params(
        "UCX") == {"num_threads": "2", "split_batch_size": "256"}


def test_agent_config_split_batch_size_reaches_ucx_only_with_two_threads_or_more():
    assert AgentConfig().init_params("UCX") == {"num_threads": "2", "split_batch_size": "16"}
    assert AgentConfig(num_threads=4, split_batch_size=64).init_params("UCX") == {
        "num_threads": "4", "split_batch_size": "64"}
    # one thread: a split would leave one chunk and only move the copy to UCX's thread
    assert AgentConfig(num_threads=1).init_params("UCX") == {"num_threads": "1"}
    assert AgentConfig(num_threads=0).init_params("UCX") == {}
    assert "split_batch_size" not in AgentConfig(backends=("UCX", "OBJ")).init_params("OBJ")
    for bad in (0, -1, True, "16"):
        with pytest.raises(ValueError, match="split_batch_size"):
            AgentConfig(split_batch_size=bad)


def test_gpu_agents_get_cuda_ipc_reads_and_user_ucx_settings_come_after():
    assert "engine_config" not in AgentConfig().init_params("UCX")
    assert AgentConfig().init_params("UCX", "VRAM")["engine_config"] == "CUDA_IPC_ENABLE_GET_ZCOPY=y"
    mine = AgentConfig(backend_params=(("UCX", "engine_config", "CUDA_IPC_ENABLE_GET_ZCOPY=n,MAX_RMA_RAILS=1"),))
    assert mine.init_params("UCX", "VRAM")["engine_config"] == (
        "CUDA_IPC_ENABLE_GET_ZCOPY=y,CUDA_IPC_ENABLE_GET_ZCOPY=n,MAX_RMA_RAILS=1")  # NIXL applies in order
    assert mine.init_params("UCX")["engine_config"] == "CUDA_IPC_ENABLE_GET_ZCOPY=n,MAX_RMA_RAILS=1"


def test_an_agent_for_gpu_memory_builds_with_its_ucx_settings():
    agent = NixlAgent("gpu-settings", AgentConfig(), mem_type="VRAM")
    try:
        assert "UCX" in agent._agent.backends
    finally:
        agent.close()
