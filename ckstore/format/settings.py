"""Repository settings (``config.json``): validated, versioned, with measured defaults."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, cast

from ckstore.codecs.objects import ENCODINGS_BY_REPO_VERSION, OFF_LOOP, Encoding
from ckstore.errors import IntegrityError, InvalidInputError, UnsupportedFormatError

CONFIG_KEY = "config.json"
REPO_FORMAT_VERSION = 6  # the newest this ckstore reads (docs/format.md): 2 added byte-grouped and
# delta chunk encodings, 3 relative link entries, 4 the predicted delta encoding, 5 local packs,
# 6 the context-sorted delta encoding. New repositories start at 2 and are upgraded when they
# first record a relative link (3), a predicted delta (4), a pack (5) or a context-sorted delta
# (6), so an older ckstore keeps reading every repository without one.
NEW_REPO_VERSION = 2
_REPOSITORY_ID = re.compile(r"[0-9a-f]{0,64}")
RELATIVE_LINKS_VERSION = 3
PREDICTED_VERSION = 4
PACKS_VERSION = 5
CONTEXT_VERSION = 6
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_ZSTD_LEVEL = 1  # measured: smaller than 3 on float byte planes, and faster (docs/benchmarks.md)
DEFAULT_MAX_DELTA_DEPTH = 4  # measured trade-off: docs/benchmarks.md
# A commit stores multi-byte chunks with plain zstd at this level (about 3x faster than byte
# grouping at level 1, for a 0.83 instead of 0.70 ratio on fp32 state); the compaction that runs
# after the commit re-encodes them (docs/design.md, "Commit, then compact"). Level 1 for bf16 (0.65
# instead of 0.83 of raw: negative levels leave literals without entropy coding) was measured and lost: its
# CPU cost more than the bytes it saved (idle, 136 MB: 0.99 against 0.89 s a commit; 3 GB: even).
FAST_ZSTD_LEVEL = -1
MAX_DELTA_DEPTH_LIMIT = 16
# git's gc.reflogExpire and gc.reflogExpireUnreachable: how long the reflog keeps commits alive.
DEFAULT_REFLOG_EXPIRE_DAYS = 90
DEFAULT_REFLOG_EXPIRE_UNREACHABLE_DAYS = 30
MAX_REFLOG_DAYS = 36500  # a century: "never" for any practical purpose


@dataclass(frozen=True)
class EncodingSettings:
    """How new chunk objects are encoded: the repository settings the object store needs."""

    zstd_level: int = DEFAULT_ZSTD_LEVEL
    max_delta_depth: int = DEFAULT_MAX_DELTA_DEPTH  # 0: never a delta
    repo_version: int = NEW_REPO_VERSION
    fast_level: int = FAST_ZSTD_LEVEL

    @property
    def allowed(self) -> frozenset[Encoding]:
        """What a commit may write: the repository's encodings but those kept off the loop."""
        return ENCODINGS_BY_REPO_VERSION[self.repo_version] - OFF_LOOP

    @property
    def allowed_off_loop(self) -> frozenset[Encoding]:
        """What compaction and repack may write: every encoding of the newest repository version
        (they upgrade the repository before staging an object its version lacks); a version-1
        repository keeps its own (repack upgrades it first)."""
        return ENCODINGS_BY_REPO_VERSION[REPO_FORMAT_VERSION] if self.repo_version >= 2 else self.allowed

    @property
    def allowed_in_compaction(self) -> frozenset[Encoding]:
        """What compaction may write: as repack, but no context-sorted delta. Trying one costs a
        second sort and compression of every delta's planes (a 271 MB fp32 epoch's compaction:
        4.4 -> 6.7 CPU s) for 1.2% fewer bytes; compaction runs beside training every epoch,
        repack when a user asks for the last bytes (docs/benchmarks.md)."""
        return self.allowed_off_loop - {Encoding.CONTEXT}


def version_for(encoding: Encoding) -> int:
    """The oldest repository format version whose objects may use ``encoding``."""
    return min(v for v, allowed in ENCODINGS_BY_REPO_VERSION.items() if encoding in allowed)


@dataclass(frozen=True)
class RepoConfig:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    max_delta_depth: int = DEFAULT_MAX_DELTA_DEPTH
    # A version-1 repository stays version 1 (raw and zstd objects only, so older ckstore can
    # still read it) until repack upgrades it.
    version: int = NEW_REPO_VERSION
    reflog_expire_days: int = DEFAULT_REFLOG_EXPIRE_DAYS
    reflog_expire_unreachable_days: int = DEFAULT_REFLOG_EXPIRE_UNREACHABLE_DAYS
    # Chosen at random when the repository is created, never changed: a process that opened the
    # repository tells from it that the folder was deleted and created again meanwhile ("" for a
    # repository created before it existed).
    repository_id: str = ""

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "ckstore": "repository",
            "version": self.version,
            "chunk_size": self.chunk_size,
            "zstd_level": self.zstd_level,
        }
        if self.version >= 2:
            doc["max_delta_depth"] = self.max_delta_depth
        doc["reflog_expire_days"] = self.reflog_expire_days
        doc["reflog_expire_unreachable_days"] = self.reflog_expire_unreachable_days
        if self.repository_id:
            doc["id"] = self.repository_id
        return (json.dumps(doc, indent=2) + "\n").encode()

    @property
    def encoding(self) -> EncodingSettings:
        return EncodingSettings(self.zstd_level, self.max_delta_depth if self.version >= 2 else 0, self.version)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RepoConfig:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise IntegrityError(f"{where} is not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("ckstore") != "repository":
            raise UnsupportedFormatError(f"{where} is not a ckstore repository configuration")
        version = doc.get("version")
        if not isinstance(version, int) or version > REPO_FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"repository format version {version} is newer than this ckstore supports ({REPO_FORMAT_VERSION});"
                " upgrade ckstore"
            )
        depth = doc.get("max_delta_depth", 0 if version == 1 else DEFAULT_MAX_DELTA_DEPTH)
        # Repositories made before the reflog have no reflog settings: the defaults apply.
        # The values are as the file has them; validate() checks each type and range.
        config = cls(
            cast(int, doc.get("chunk_size")),
            cast(int, doc.get("zstd_level")),
            depth,
            version,
            doc.get("reflog_expire_days", DEFAULT_REFLOG_EXPIRE_DAYS),
            doc.get("reflog_expire_unreachable_days", DEFAULT_REFLOG_EXPIRE_UNREACHABLE_DAYS),
            doc.get("id", ""),
        )
        config.validate(where)
        return config

    def validate(self, where: str = "configuration") -> None:
        if not isinstance(self.chunk_size, int) or not 4096 <= self.chunk_size <= 1 << 28:
            raise InvalidInputError(f"{where}: chunk_size must be between 4 KiB and 256 MiB")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise InvalidInputError(f"{where}: zstd_level must be between 1 and 22")
        if not isinstance(self.max_delta_depth, int) or not 0 <= self.max_delta_depth <= MAX_DELTA_DEPTH_LIMIT:
            raise InvalidInputError(f"{where}: max_delta_depth must be between 0 and {MAX_DELTA_DEPTH_LIMIT}")
        for name in ("reflog_expire_days", "reflog_expire_unreachable_days"):
            days = getattr(self, name)
            if isinstance(days, bool) or not isinstance(days, int) or not 0 <= days <= MAX_REFLOG_DAYS:
                raise InvalidInputError(f"{where}: {name} must be a whole number of days from 0 to {MAX_REFLOG_DAYS}")
        if not isinstance(self.repository_id, str) or not _REPOSITORY_ID.fullmatch(self.repository_id):
            raise InvalidInputError(f"{where}: id must be up to 64 lowercase hex digits")
        if not isinstance(self.version, int) or not 1 <= self.version <= REPO_FORMAT_VERSION:
            raise UnsupportedFormatError(f"{where}: unknown repository format version {self.version}")
