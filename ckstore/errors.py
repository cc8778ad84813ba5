"""Every failure ckstore reports, one class each.

The error classes are the command-line contract (as in borg): each carries its exit code, and its
message is one line that names what failed and, where it helps, what to do. The CLI prints
``ckstore: <message>`` and exits with ``exit_code``; nothing else is shown to the user.

Exit codes (documented in README.md):
  1  generic failure            5  invalid input (bad file, bad name, unencodable value)
  2  usage error (click)        6  conflict: lock held, ref moved, output exists
  3  not found                  7  storage failure (no space, I/O error)
  4  integrity: corrupt data    8  unsupported repository format
"""

from __future__ import annotations


class CkstoreError(Exception):
    """Base of all errors ckstore raises on purpose."""

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        # One line always: a message that spans lines would break the CLI contract.
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return str(self)


class MissingDependencyError(CkstoreError):
    """An optional dependency (torch for legacy import) is missing or too old."""


class NotFoundError(CkstoreError):
    exit_code = 3


class RepoNotFoundError(NotFoundError):
    """No repository at the given path, in CKSTORE_REPO, or above the current directory."""


class RefNotFoundError(NotFoundError):
    """A branch, tag, commit id or prefix that resolves to nothing."""


class TensorNotFoundError(NotFoundError):
    """A tensor or safetensors file name that the commit does not hold (partial reads)."""


class ObjectMissingError(NotFoundError):
    """A referenced object is absent from the object store."""


class PackGoneError(ObjectMissingError):
    """A remote pack a reader located was deleted before it was read: a push deleted it as
    superseded (every object in it is held in another pack), so the reader looks again."""


class DependentNotFoundError(NotFoundError):
    """An overlay repository listed in ``dependents`` cannot be opened: gc refuses rather than
    delete what it may need (it may have moved)."""


class BaseUnreachableError(NotFoundError):
    """An overlay's base repository does not open (moved or unmounted): fsck finds nothing it can
    call damaged, only data it cannot reach until ``relink`` (exit 3, not 4)."""


class IntegrityError(CkstoreError):
    """Stored data does not match its name, or cannot be decoded: the repository is damaged."""

    exit_code = 4


class ObjectCorruptError(IntegrityError):
    """One object (``oid``) does not decode to its name; ``reason`` says why."""

    def __init__(self, message: str, oid: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.oid, self.reason = oid, reason


class InvalidInputError(CkstoreError):
    """Input the user gave is malformed: a file, a name, a value, an option."""

    exit_code = 5


class SafetensorsFormatError(InvalidInputError):
    """A file named .safetensors that violates the safetensors format."""


class UnsafeCheckpointError(InvalidInputError):
    """A pickle checkpoint that torch's weights_only loader refuses (it would need arbitrary code)."""


class PickleCheckpointError(InvalidInputError):
    """A pickle checkpoint given to commit, which would store it as one opaque blob (import converts it)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class InvalidRefNameError(InvalidInputError):
    """A ref name that check-ref-format rules reject."""


class InvalidPathError(InvalidInputError):
    """A file path that is absolute, escapes its root, or holds forbidden characters."""


class AmbiguousRefError(InvalidInputError):
    """A commit id prefix that matches more than one commit."""


class UnencodableValueError(InvalidInputError):
    """A value that cannot be stored without pickle."""


class ConflictError(CkstoreError):
    exit_code = 6


class RepoReplacedError(ConflictError):
    """The repository folder was deleted and created again since this process opened it."""


class LockedError(ConflictError):
    """A lock is held by another process (or was left by a dead one)."""


class RefChangedError(ConflictError):
    """A compare-and-swap ref update lost: the ref moved since it was read."""


class OutputExistsError(ConflictError):
    """Checkout would overwrite a different existing file without --force; init or clone into a
    folder that holds something else."""


class RefExistsError(ConflictError):
    """Creating a branch or tag that already exists."""


class ForceRequiredError(ConflictError):
    """An action that could lose commits without --force: deleting the current or the only
    branch, a gc that would delete every commit."""


class StorageError(CkstoreError):
    """The storage backend failed: no space left, an I/O error, permissions."""

    exit_code = 7
    no_space = False  # the device (or a quota) is full: freeing space elsewhere may let it succeed


class OutputError(StorageError):
    """Standard output cannot be written (a full device, an I/O error, a closed descriptor)."""


class UnsupportedFormatError(CkstoreError):
    """The repository was written by a newer ckstore, or is not a ckstore repository."""

    exit_code = 8


class CkstoreWarning(UserWarning):
    """Something worth knowing that is not a failure (the CLI prints ``ckstore: warning: …``)."""
