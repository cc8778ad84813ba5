"""MLflow: the manifest is the truth, MLflow is the index.

    import mlflow, ckstore.integrations.mlflow as ckmlflow
    ckmlflow.autolog()
    with mlflow.start_run():
        repo.commit_state(state, metadata={"epoch": 3, "val_loss": 0.31})   # linked both ways

After ``autolog()``, every commit prepared in a thread with an active MLflow run (or while
``MLFLOW_RUN_ID`` is set, MLflow's own variable for a run to resume) records the run in its
provenance (``mlflow_run_id``, ``mlflow_tracking_uri``: the commit names its run), and once the
commit stands it is logged to the run (the run lists its commits): the run's tags
``ckstore.commit`` (the newest), ``ckstore.repository`` and ``ckstore.branch``; the commit's
numeric metadata as metrics at its ``step`` (else ``epoch``); and an MLflow 3 ``LoggedModel``
named ``ckstore-<id>``, tagged with the commit and the repository, which is the pointer that
opens it (``models:/<model_id>``). ``ckstore commit`` does the same when ``MLFLOW_RUN_ID`` is set.

Back from MLflow: ``commits(run_id)`` lists a run's commits, ``register_commit(name, repo, ref)``
makes a registered model version point at a commit, and ``load_model_version(name, version)`` /
``load_state("models:/NAME/VERSION")`` load it through ckstore (no pickle, no MLflow artifact).
MLflow is imported only by the calls that need it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from ckstore.errors import CkstoreWarning, InvalidInputError, MissingDependencyError, NotFoundError
from ckstore.write import hooks

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from ckstore.repo import Repo
    from ckstore.training.state import Device

RUN_ID = "mlflow_run_id"  # provenance keys (docs/format.md, section 5)
TRACKING_URI = "mlflow_tracking_uri"
TAG_COMMIT = "ckstore.commit"
TAG_REPOSITORY = "ckstore.repository"
TAG_BRANCH = "ckstore.branch"
HOOK = "mlflow"
_METRIC_NAME = re.compile(r"^[\w./\- :]{1,250}$")  # what MLflow accepts as a metric key


@dataclass(frozen=True)
class RunLink:
    """The MLflow run a commit was made in."""

    run_id: str
    tracking_uri: str

    @property
    def uri(self) -> str:
        return f"runs:/{self.run_id}"


@dataclass(frozen=True)
class CommitLink:
    """A ckstore commit as MLflow knows it: the commit, its repository, the LoggedModel naming it."""

    commit: str
    repository: str | None
    branch: str | None = None
    model_id: str | None = None
    step: int | None = None

    def open(self) -> Repo:
        from ckstore.repo import Repo

        if not self.repository:
            raise NotFoundError(f"MLflow names commit {self.commit} but no repository it lives in")
        return Repo(self.repository)


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise MissingDependencyError("ckstore.integrations.mlflow needs MLflow: pip install mlflow") from None
    return mlflow


def _client(tracking_uri: str | None = None) -> MlflowClient:
    return _mlflow().tracking.MlflowClient(tracking_uri)


def without_credentials(uri: str) -> str:
    """``uri`` with any user:password removed: a manifest is shared, a password must not be."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


# ---- the commit's side: which run -----------------------------------------------------------------


def active_link() -> dict[str, str]:
    """Provenance for a commit prepared now: the active run of this thread, else ``MLFLOW_RUN_ID``."""
    mlflow = _mlflow()
    run = mlflow.active_run()
    run_id = run.info.run_id if run is not None else os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return {}
    return {RUN_ID: run_id, TRACKING_URI: without_credentials(mlflow.get_tracking_uri())}


def run_of(repo: Repo, ref: str = "HEAD") -> RunLink | None:
    """The MLflow run the commit ``ref`` was made in, from its manifest (None: made outside one)."""
    _, commit = repo.show(ref)
    return link_in(commit.provenance)


def link_in(provenance: Mapping[str, str]) -> RunLink | None:
    """The run a commit's provenance names, or None."""
    run_id = provenance.get(RUN_ID)
    return RunLink(run_id, provenance.get(TRACKING_URI, "")) if run_id else None


# ---- the run's side: which commits ------------------------------------------------------------------


def _step(metadata: Mapping[str, Any]) -> int:
    for key in ("step", "global_step", "epoch"):
        value = metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    return 0


def numeric_metrics(metadata: Mapping[str, Any]) -> dict[str, float]:
    """The metadata entries MLflow can chart: finite-or-not numbers under names it accepts."""
    return {
        key: float(value)
        for key, value in metadata.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _METRIC_NAME.match(key)
    }


def log_commit(done: hooks.Recorded) -> CommitLink | None:
    """Log a recorded commit to the run its provenance names; None when it names none."""
    link = link_in(done.commit.provenance)
    if link is None:
        return None
    mlflow = _mlflow()
    client = _client(link.tracking_uri or None)
    run = client.get_run(link.run_id)
    metadata = done.commit.decoded_metadata()
    step = _step(metadata)
    tags = {TAG_COMMIT: done.id, TAG_BRANCH: done.commit.branch}
    if done.repository is not None:
        tags[TAG_REPOSITORY] = str(Path(done.repository).resolve())
    model = client.create_logged_model(
        run.info.experiment_id,
        name=f"ckstore-{done.id[:12]}",
        source_run_id=link.run_id,
        tags=tags,
        params={"message": done.commit.message[:500]} if done.commit.message else None,
        model_type="ckstore",
    )
    when = int(_epoch_ms(done.commit.time))
    metrics = [
        mlflow.entities.Metric(key, value, when, step, model_id=model.model_id)
        for key, value in numeric_metrics(metadata).items()
    ]
    run_tags = [mlflow.entities.RunTag(k, v) for k, v in tags.items()]
    client.log_batch(link.run_id, metrics=metrics, tags=run_tags)
    client.finalize_logged_model(model.model_id, "READY")
    return CommitLink(done.id, tags.get(TAG_REPOSITORY), done.commit.branch, model.model_id, step)


def _epoch_ms(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000


def _from_model(model: Any) -> CommitLink:
    tags = model.tags or {}
    if TAG_COMMIT not in tags:
        raise NotFoundError(f"MLflow model {model.model_id} does not point at a ckstore commit")
    step = min((m.step for m in model.metrics or ()), default=None)
    return CommitLink(tags[TAG_COMMIT], tags.get(TAG_REPOSITORY), tags.get(TAG_BRANCH), model.model_id, step)


def commits(run_id: str, tracking_uri: str | None = None) -> list[CommitLink]:
    """The ckstore commits logged to the run ``run_id``, oldest first."""
    client = _client(tracking_uri)
    run = client.get_run(run_id)
    found: list[Any] = []
    token = None
    while True:
        page = client.search_logged_models(
            [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'", page_token=token
        )
        found += [m for m in page if TAG_COMMIT in (m.tags or {})]
        token = page.token
        if not token:
            break
    found.sort(key=lambda m: m.creation_timestamp)
    return [_from_model(m) for m in found]


# ---- registered models --------------------------------------------------------------------------


def register_commit(name: str, repo: Repo, ref: str = "HEAD", tracking_uri: str | None = None) -> Any:
    """A new version of the registered model ``name`` that points at commit ``ref``; the
    ``ModelVersion``. It reuses the commit's LoggedModel when autolog made one."""
    client = _client(tracking_uri)
    oid, commit = repo.show(ref)
    link = link_in(commit.provenance)
    model_id = _logged_model_of(client, oid, link)
    if repo.path is None:
        raise InvalidInputError("an in-memory repository cannot back a registered model")
    location = str(Path(repo.path).resolve())
    tags = {TAG_COMMIT: oid, TAG_REPOSITORY: location, TAG_BRANCH: commit.branch}
    if model_id is None:
        experiment = client.get_run(link.run_id).info.experiment_id if link else _default_experiment(client)
        model = client.create_logged_model(
            experiment, name=f"ckstore-{oid[:12]}", source_run_id=link.run_id if link else None, tags=tags
        )
        client.finalize_logged_model(model.model_id, "READY")
        model_id = model.model_id
    mlflow = _mlflow()
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(name)
    return client.create_model_version(
        name, source=f"models:/{model_id}", run_id=link.run_id if link else None, tags=tags, model_id=model_id
    )


def _default_experiment(client: MlflowClient) -> str:
    experiment = client.get_experiment_by_name("Default")
    return experiment.experiment_id if experiment is not None else "0"


def _logged_model_of(client: MlflowClient, oid: str, link: RunLink | None) -> str | None:
    if link is None:
        return None
    run = client.get_run(link.run_id)
    models = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{link.run_id}'", max_results=1000
    )
    return next((m.model_id for m in models if (m.tags or {}).get(TAG_COMMIT) == oid), None)


def resolve(uri: str, tracking_uri: str | None = None) -> CommitLink:
    """The commit an MLflow URI names: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``,
    ``models:/<model_id>`` (a LoggedModel) or ``runs:/<run_id>`` (the run's newest commit)."""
    client = _client(tracking_uri)
    if uri.startswith("runs:/"):
        run_id = uri[len("runs:/") :].strip("/").split("/")[0]
        found = commits(run_id, tracking_uri)
        if not found:
            raise NotFoundError(f"MLflow run {run_id} has no ckstore commit")
        return found[-1]
    if not uri.startswith("models:/"):
        raise InvalidInputError(f"not an MLflow model or run URI: {uri!r} (models:/NAME/VERSION, runs:/RUN_ID)")
    rest = uri[len("models:/") :].strip("/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return _from_version(client, client.get_model_version_by_alias(name, alias))
    if "/" in rest:
        name, version = rest.split("/", 1)
        return _from_version(client, client.get_model_version(name, version))
    return _from_model(client.get_logged_model(rest))


def _from_version(client: MlflowClient, version: Any) -> CommitLink:
    tags = version.tags or {}
    if TAG_COMMIT in tags:
        return CommitLink(tags[TAG_COMMIT], tags.get(TAG_REPOSITORY), tags.get(TAG_BRANCH), version.model_id)
    source = version.source or ""
    if source.startswith("models:/"):
        return _from_model(client.get_logged_model(source[len("models:/") :]))
    raise NotFoundError(f"model version {version.name} {version.version} does not point at a ckstore commit")


def load_state(uri: str, only: str | None = None, device: Device = "cpu", tracking_uri: str | None = None) -> Any:
    """The training state of the commit an MLflow URI names (``resolve``), read through ckstore."""
    link = resolve(uri, tracking_uri)
    return link.open().load_state(link.commit, only=only, device=device)


def load_model_version(
    name: str, version: str | int, only: str | None = None, device: Device = "cpu", tracking_uri: str | None = None
) -> Any:
    """The training state of version ``version`` of the registered model ``name``."""
    return load_state(f"models:/{name}/{version}", only=only, device=device, tracking_uri=tracking_uri)


# ---- switching it on ----------------------------------------------------------------------------


def autolog(disable: bool = False) -> None:
    """Link every commit made from now on to the active MLflow run (``disable=True``: stop)."""
    if disable:
        hooks.unregister(HOOK)
        return
    _mlflow()  # a missing MLflow is an error now, not at the first commit
    hooks.register(hooks.CommitHook(HOOK, active_link, log_commit))


# What a ``ckstore commit`` process asks of MLflow's HTTP client unless the user set it: a training
# script waits for the command, and MLflow's own defaults (7 retries with exponential backoff,
# 120 s a request) keep a commit waiting over four minutes for a tracking server that is down,
# while the commit itself stands either way (a one-line warning says the run was not told).
CLI_TRACKING_REQUESTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def autolog_from_environment() -> bool:
    """``autolog()`` when ``MLFLOW_RUN_ID`` names a run (the CLI calls this, in its own process);
    whether it did. Requests to the tracking server are bounded (``CLI_TRACKING_REQUESTS``).

    Without MLflow installed this warns and links nothing: the checkpoint matters more."""
    if not os.environ.get("MLFLOW_RUN_ID"):
        return False
    for name, value in CLI_TRACKING_REQUESTS.items():
        os.environ.setdefault(name, value)
    try:
        autolog()
    except MissingDependencyError as exc:
        warnings.warn(CkstoreWarning(f"MLFLOW_RUN_ID is set but the commit is not linked to it: {exc}"), stacklevel=2)
        return False
    return True
