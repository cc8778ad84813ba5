"""DCP saves and loads straight to a remote (ckstore/dcp/remote.py), against two independent S3
implementations: SeaweedFS (a real server) and moto's server (an emulator), both on 127.0.0.1.

The ranks are torchrun launches of tests/dcp/worker.py (FSDP2 on CPU with gloo); the cluster
test runs two "machines" on this host, each its own torchrun launch with its own HOME, TMPDIR
and working folder, joined by a c10d rendezvous, so no folder is shared between them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckstore
import ckstore.dcp
import ckstore.dcp.remote as remote_module
from ckstore.backend.memory import MemoryBackend
from ckstore.dcp.remote import RemoteView, find_target
from ckstore.errors import CkstoreError
from ckstore.remote.layout import RemoteRepo, index_key, pack_key
from ckstore.repository.refs import HEADS, TAGS
from ckstore.transport.testserver import S3Server, free_ports
from tests.dcp.test_storage import WORKER, assert_same_tensors, checkout_full, report, torchrun
from tests.remote.faultproxy import FaultProxy

MOTO_BUCKET = "ckstore-moto"


@dataclass(frozen=True)
class Bucket:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    def url(self) -> str:
        return f"s3://{self.bucket}/dcp/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def moto_bucket() -> Iterator[Bucket]:
    import boto3
    from moto.server import ThreadedMotoServer

    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    bucket = Bucket(f"http://127.0.0.1:{port}", "moto-key", "moto-secret", MOTO_BUCKET)
    client = boto3.client(
        "s3",
        endpoint_url=bucket.endpoint,
        aws_access_key_id=bucket.access_key,
        aws_secret_access_key=bucket.secret_key,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=MOTO_BUCKET)
    yield bucket
    server.stop()


@pytest.fixture(params=["seaweedfs", "moto"])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A bucket on each S3 implementation, its settings in this process's environment (the
    torchrun launches inherit them)."""
    if request.param == "seaweedfs":
        server: S3Server = request.getfixturevalue("s3_server")
        found = Bucket(server.endpoint, server.access_key, server.secret_key, server.bucket)
    else:
        found = request.getfixturevalue("moto_bucket")
    for name, value in found.env().items():
        monkeypatch.setenv(name, value)
    return found


def _single_save(url: str, scale: float, **kwargs: Any) -> str:
    """One save from this process (no process group: a world of one)."""
    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64) * scale, "step": int(scale)}
    return ckstore.dcp.saved_commit(dcp.save(state, storage_writer=ckstore.dcp.Writer(url, **kwargs)))


def _cause(exc: BaseException) -> BaseException:
    """The error a rank raised, out of the CheckpointException DCP wraps it in."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


def _ref(url: str, ref: str) -> str | None:
    return find_target(url).open().read_ref(ref)[0]


def _packs(url: str) -> set[str]:
    return find_target(url).open().pack_ids()


def test_two_ranks_save_and_resume_and_clone_checks_out_the_saves(bucket: Bucket, tmp_path: Path) -> None:
    url = bucket.url()
    out = tmp_path / "out"
    out.mkdir()
    torchrun(2, "train", url, str(out), "main")
    rep = report(out)
    assert rep["resumed"] == rep["losses"][1:], "resuming from the first save continues bit-identically"
    assert rep["step"] == 0 and dict(rep["run"])["lr"] == 1e-3
    assert _ref(url, HEADS + "main") == rep["commits"][-1]
    # The saves are ordinary commits to a clone: log, and a checkout bit-identical to the state.
    clone, _ = ckstore.Repo.clone(url, tmp_path / "clone")
    assert [e.id for e in clone.log("main")] == rep["commits"][::-1]
    statuses = {(c.name or "").split("@")[0]: c.status for c in clone.diff(rep["commits"][0], rep["commits"][1])}
    assert statuses["model.l1.weight"] == "changed" and statuses["model.embed.weight"] == "unchanged", statuses
    want = load_file(out / "full.safetensors")
    got = checkout_full(clone, rep["commits"][-1], tmp_path / "co")
    assert_same_tensors({k: got[k] for k in want}, want)
    assert torch.equal(got["replicated"], got["replicated_copy"])
    # Later steps send far less than the first: unchanged pieces are on the remote already.
    sizes = [clone.read_commit(c).added_bytes for c in rep["commits"]]
    assert sizes[1] < sizes[0] * 0.8 and sizes[2] < sizes[0] * 0.8, sizes
    # Retention on the bucket: keep the newest two saves; the newest still loads from the remote.
    assert clone.gc_remote(keep_last=2, grace=0).pruned_commits == [rep["commits"][0]]
    assert ckstore.dcp.latest(url) == rep["commits"][-1]


def test_a_load_reads_at_another_world_size_and_only_from_the_remote(bucket: Bucket, tmp_path: Path) -> None:
    url = bucket.url()
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    torchrun(2, "train", url, str(two), "main")
    last = report(two)["commits"][-1]
    cache = tmp_path / "cache"
    env = {"CKSTORE_CACHE_DIR": str(cache)}
    _torchrun_env(1, env, "load", url, str(one), last, "w1")  # 2 -> 1, then saves again on w1
    assert_same_tensors(load_file(one / "full.safetensors"), load_file(two / "full.safetensors"))
    loaded = report(one)
    assert loaded["step"] == 2
    assert _ref(url, HEADS + "w1") == loaded["commit"]
    assert any((cache / "remotes").iterdir()), "the cache folder keeps what was read"


def _torchrun_env(nproc: int, env: dict[str, str], *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER)]
    result = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **env}
    )
    assert result.returncode == 0, result.stderr[-8000:]


def test_a_name_after_the_remote_is_a_tag_and_reads_back(bucket: Bucket) -> None:
    url = bucket.url()
    first = _single_save(url, 1.0)
    tagged = _single_save(url + "/step-2", 2.0, message="two")
    assert _ref(url, TAGS + "step-2") == tagged
    assert _ref(url, HEADS + "main") == tagged
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(out, storage_reader=ckstore.dcp.Reader(url + "/step-2"))
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64) * 2.0) and out["step"] == 2
    dcp.load(out, storage_reader=ckstore.dcp.Reader(url, ref=first))
    assert out["step"] == 1
    # Call sites that pass the URL as checkpoint_id (torchtitan's and Lightning's managers).
    state = {"w": torch.ones(64, 64), "step": 3}
    meta = dcp.save(state, checkpoint_id=url + "/step-3", storage_writer=ckstore.dcp.Writer())
    assert _ref(url, TAGS + "step-3") == ckstore.dcp.saved_commit(meta) == ckstore.dcp.latest(url + "/step-3")
    dcp.load(out, checkpoint_id=url + "/step-3", storage_reader=ckstore.dcp.Reader())
    assert out["step"] == 3 and torch.equal(out["w"], state["w"])
    assert ckstore.dcp.latest(bucket.url()) is None  # nothing saved there yet


def test_two_jobs_saving_to_one_branch_at_once_both_land_one_on_the_other(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bucket.url()
    base = _single_save(url, 1.0)
    results: dict[float, str] = {}
    errors: list[BaseException] = []
    # Both coordinators read the branch and upload their commits before either swaps it.
    barrier, waited = threading.Barrier(2, timeout=120), set()
    upload = remote_module.send_objects

    def in_step(store: Any, remote: Any, wanted: list[str], *args: Any) -> Any:
        sent = upload(store, remote, wanted, *args)
        commit_upload = isinstance(store.backend, MemoryBackend)  # land_save's store of the commit
        if commit_upload and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait()
        return sent

    monkeypatch.setattr(remote_module, "send_objects", in_step)

    def save(scale: float) -> None:
        try:
            results[scale] = _single_save(url, scale)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(scale,)) for scale in (2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, [_cause(e) for e in errors]
    # The compare-and-swap lets one land first; the other re-parents onto it: none is lost.
    view = RemoteView(find_target(url))
    tip = view.resolve("main")
    history = [tip]
    while parents := view.graph.read_commit(history[-1]).parents:
        history.append(parents[0])
    assert set(history) == {base, *results.values()} and history[-1] == base
    assert len(waited) == 2, "both commits were built on the same tip"


def test_a_rank_killed_mid_upload_moves_no_branch_and_remote_gc_removes_its_packs(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bucket.url()
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKSTORE_CACHE_DIR", str(cache))
    before = _single_save(url, 1.0)
    packs = _packs(url)
    result = torchrun(2, "kill-upload", url, str(tmp_path), "main", check=False)
    assert result.returncode != 0
    assert _ref(url, HEADS + "main") == before, "the branch stays where it was"
    assert not (cache / "stage").exists(), "a rank stages nothing on local disk: nothing is left behind"
    orphans = _packs(url) - packs
    assert orphans, "the killed rank had uploaded a pack"
    # Remote gc's two phases: the first run condemns what no ref needs, the next deletes it.
    clone, _ = ckstore.Repo.clone(url, tmp_path / "clone")
    # gc condemns only packs older than the store's clock resolution: wait until they are.
    deadline = time.monotonic() + 30
    while not set(clone.gc_remote(grace=0, dry_run=True).condemned) >= orphans and time.monotonic() < deadline:
        time.sleep(0.2)
    assert clone.gc_remote(grace=0).condemned
    assert set(clone.gc_remote(grace=0).deleted) >= orphans
    assert not orphans & _packs(url)
    after = _single_save(url, 3.0)  # the next save succeeds, on top of the branch as it was
    clone.fetch()
    assert [e.id for e in clone.log("origin/main")] == [after, before]


def test_a_pack_a_save_deduplicates_against_that_a_sweep_claims_meanwhile_is_sent_again(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bucket.url()
    _single_save(url, 1.0)
    first = _packs(url)
    rescue = RemoteRepo.rescue
    swept: list[set[str]] = []

    def sweep_first(self: RemoteRepo, packs: set[str]) -> set[str]:
        # A remote gc's sweep claims the first save's packs after the rank found its chunks
        # there and before it rescued them (a save slower than the grace period).
        if not swept:
            condemned = self.read_condemned()
            condemned.packs.update({p: (time.time(), True) for p in first})
            assert self.write_condemned(condemned)
            swept.append(packs & first)
        return rescue(self, packs)

    monkeypatch.setattr(RemoteRepo, "rescue", sweep_first)
    second = _single_save(url, 1.0)  # the same state: every chunk is one the first save sent
    assert swept and swept[0], "the save relied on the first save's packs"
    remote = find_target(url).open()
    for pack in first:  # the sweep deletes what it claimed
        remote.transport.delete(pack_key(pack))
        remote.transport.delete(index_key(pack))
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(out, storage_reader=ckstore.dcp.Reader(url, ref=second))
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64)) and out["step"] == 1


def test_a_server_that_ignores_conditional_writes_is_refused(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_server.bucket}/dcp/{uuid.uuid4().hex}"
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.ignore_conditions = True
        with pytest.raises(BaseException) as caught:
            _single_save(url, 1.0, endpoint_url=proxy.url)
        cause = _cause(caught.value)
        assert isinstance(cause, CkstoreError) and "ignores conditional writes" in str(cause)
        remote = find_target(url, proxy.url).open()
        assert not remote.list_refs() and not remote.check_format(), "no remote was made there"


def test_async_save_uploads_in_the_background_and_a_failure_surfaces_on_the_future(bucket: Bucket) -> None:
    url = bucket.url()
    state = {"w": torch.randn(256, 256), "step": 1}
    future = dcp.async_save(state, storage_writer=ckstore.dcp.Writer(url))
    commit = ckstore.dcp.saved_commit(future.result())
    assert _ref(url, HEADS + "main") == commit
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x"
    failing = dcp.async_save(state, storage_writer=ckstore.dcp.Writer(missing))
    with pytest.raises(BaseException) as caught:
        failing.result()
    cause = _cause(caught.value)
    assert isinstance(cause, CkstoreError) and "no-such-bucket" in str(cause), cause


# ---- two machines on one host -------------------------------------------------------------------


def _machine(home: Path, node: int, port: int, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """One "machine": a torchrun launch of 2 ranks as node ``node`` of 2, in its own folders."""
    for sub in ("home", "tmp", "work/out"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        str(WORKER),
        *args,
    ]
    own = {"HOME": str(home / "home"), "TMPDIR": str(home / "tmp"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd,
        cwd=home / "work",
        env={**os.environ, **env, **own},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _cluster(root: Path, env: dict[str, str], *args: str) -> None:
    (port,) = free_ports(1)
    machines = [_machine(root / f"machine-{k}", k, port, env, *args) for k in range(2)]
    outputs = []
    for proc in machines:
        try:
            out, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in machines:
                p.kill()
            raise
        outputs.append(out)
    assert all(p.returncode == 0 for p in machines), "\n---\n".join(o[-6000:] for o in outputs)


@pytest.mark.slow
def test_two_machines_that_share_no_folder_save_and_resume_at_1_2_and_4_ranks(bucket: Bucket, tmp_path: Path) -> None:
    url = bucket.url()
    cluster = tmp_path / "cluster"
    # "out" is relative: each machine writes into its own working folder (rank 0 is on machine 0).
    _cluster(cluster, {}, "train", url, "out", "main")
    rep = report(cluster / "machine-0" / "work" / "out")
    assert rep["world"] == 4 and rep["resumed"] == rep["losses"][1:]
    assert not (cluster / "machine-1" / "work" / "out" / "report.json").exists()
    full = load_file(cluster / "machine-0" / "work" / "out" / "full.safetensors")
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        out.mkdir()
        _torchrun_env(n, {}, "load", url, str(out), rep["commits"][-1], f"w{n}")
        assert_same_tensors(load_file(out / "full.safetensors"), full)
