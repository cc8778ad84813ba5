"""A repository holding predicted deltas (consecutive AdamW steps through DCP) goes through a
remote intact: push sends every base a predicted delta names, a clone reads every commit
bit-exact, keeps the objects as predicted deltas and is upgraded to format 4 itself."""

from __future__ import annotations

import json
from pathlib import Path

from ckstore.repo import Repo
from tests.helpers import assert_reads_back, dcp_adamw_run, encodings


def test_push_and_clone_of_predicted_deltas_read_back_bit_exact(
    remote_url: tuple[str, str | None], tmp_path: Path
) -> None:
    url, endpoint = remote_url
    a = Repo.init(tmp_path / "a", chunk_size=16384)
    runs = dcp_adamw_run(a, 4)
    assert encodings(a).get("PREDICTED", 0) > 0
    a.add_remote("origin", url, endpoint_url=endpoint)
    a.push()
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert encodings(b).get("PREDICTED") == encodings(a)["PREDICTED"]  # stayed predicted on the way
    # 4 allows predicted deltas; the clone is 5, as its objects landed in local packs.
    assert json.loads((tmp_path / "b" / "config.json").read_text())["version"] >= 4
    assert_reads_back(b, runs, tmp_path / "out")
    assert b.fsck(read_data=True) == []


def test_clone_from_version_1_packs_decodes_each_predicted_delta_against_its_bases(tmp_path: Path) -> None:
    """Without digests every object is decoded on arrival: a predicted delta waits until all of
    its bases (which may arrive after it) are verified."""
    from ckstore.transport import open_transport

    from .test_verify import rewrite_as_version_1

    url = str(tmp_path / "remote")
    a = Repo.init(tmp_path / "a", chunk_size=16384)
    runs = dcp_adamw_run(a, 3)
    a.add_remote("origin", url)
    a.push()
    rewrite_as_version_1(open_transport(url, None))
    b, _ = Repo.clone(url, tmp_path / "b")
    assert encodings(b).get("PREDICTED") == encodings(a)["PREDICTED"]
    assert_reads_back(b, runs, tmp_path / "out")
    assert b.fsck(read_data=True) == []
