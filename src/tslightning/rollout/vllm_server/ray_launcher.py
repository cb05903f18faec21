"""The Ray launcher of the ``vllm_server`` engine's replicas (``rollout.launcher: ray``, README: Ray launcher).

:class:`RayReplicas` connects to a Ray cluster (``rollout.ray.address``), starts ``rollout.ray.replicas`` vLLM
servers, each a Ray actor (:class:`~tslightning.rollout.vllm_server.ray_replica.ReplicaServer`) holding ``num_cpus`` /
``num_gpus`` of the cluster, waits until each answers ``/health`` and hands their URLs to the engine. A thread then
checks every replica's ``/health`` each ``health_interval_s``; a replica whose server exited, or that misses
:data:`MISSES_BEFORE_RESTART` checks in a row (or that the engine reports :meth:`lost`), is restarted — its actor
killed, a new one started — under a new *generation*. The engine asks :meth:`RayReplicas.serving` at each
publication and takes a restarted replica back into rotation only after it published the current policy version to
it (:mod:`tslightning.rollout.vllm_server.engine`).

With ``rollout.ray.teacher`` (OPD), :func:`launch_teacher` starts the frozen teacher the same way: one
:class:`RayReplicas` of ``role`` ``teacher`` holding ``teacher_num_cpus`` / ``teacher_num_gpus``, restarted when it
dies and never published to; :class:`~tslightning.rollout.teacher_server.TeacherServer` resends a turn whose request
failed to the restarted server.

Learner ranks stay on Fabric; only the servers run on Ray. Ray is imported when the launcher starts (the ``ray``
extra); the settings import nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tslightning.rollout.vllm_server.check import answers

__all__ = ["RayReplicas", "RaySettings", "ReplicaFailed", "launch_teacher"]


@dataclass
class RaySettings:
    """Where and how the Ray launcher runs the vLLM server replicas."""

    address: str | None = None
    """The Ray cluster: ``auto`` (the one ``ray start`` runs on this node), a GCS ``host:port``, or ``None`` to start a
    one-node cluster inside ``fit`` (stopped when it ends)."""
    replicas: int = 2
    """vLLM servers to run, one Ray actor each."""
    num_cpus: float = 1.0
    """Ray CPUs each replica holds."""
    num_gpus: float = 0.0
    """Ray GPUs each replica holds (its server sees them as ``CUDA_VISIBLE_DEVICES``; give ``tensor_parallel_size``
    of them for ``rollout.vllm.tensor_parallel_size``)."""
    server_host: str | None = None
    """The address each server listens on; ``None``: its node's IP. ``127.0.0.1`` keeps a one-node run on loopback."""
    server_args: list[str] = field(default_factory=list)
    """More ``api_server`` flags for every replica, e.g. ``[--kv-cache-memory-bytes, '268435456']`` on CPU."""
    log_dir: str | None = None
    """Where each node writes its replicas' output (``replica-<i>-<generation>.log``); ``None``: ``<out_dir>/replicas``
    (on a shared file system, every node's logs in one place)."""
    startup_timeout_s: float = 600.0
    """Seconds a replica may take to answer ``/health`` after its actor started."""
    health_interval_s: float = 5.0
    """Seconds between two ``/health`` checks of each replica."""
    wait_for_restarts: bool = False
    """A publication first waits (``startup_timeout_s`` at most) for replicas being restarted, so it reaches all of
    them; ``false``: it publishes to those serving and a restarted replica joins at the next publication."""
    teacher: bool = False
    """OPD: also launch the frozen teacher (``model.teacher_path``, else the embedded ``<out_dir>/teacher-0``) as one
    vLLM server on Ray, health-checked and restarted like a replica, that ``fit`` scores on (no ``teacher_url``)."""
    teacher_num_cpus: float = 1.0
    """Ray CPUs the teacher's server holds (``teacher: true``)."""
    teacher_num_gpus: float = 0.0
    """Ray GPUs the teacher's server holds (``teacher: true``)."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``rollout.ray.*``) and the fix."""
        problems = []
        if self.replicas < 1:
            problems.append(f"rollout.ray.replicas must be >= 1; got {self.replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.num_cpus + self.num_gpus <= 0:
            problems.append(
                f"rollout.ray.num_cpus and rollout.ray.num_gpus must be >= 0 and not both 0; got {self.num_cpus}, "
                f"{self.num_gpus}"
            )
        teacher = (self.teacher_num_cpus, self.teacher_num_gpus)
        if self.teacher and (min(teacher) < 0 or sum(teacher) <= 0):
            problems.append(
                "rollout.ray.teacher_num_cpus and rollout.ray.teacher_num_gpus must be >= 0 and not both 0; got "
                f"{self.teacher_num_cpus}, {self.teacher_num_gpus}"
            )
        for name in ("startup_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                problems.append(f"rollout.ray.{name} must be > 0; got {getattr(self, name)}")
        return problems


MISSES_BEFORE_RESTART = 3
"""``/health`` checks in a row a running server may miss before it is restarted."""


class ReplicaFailed(RuntimeError):
    """A replica did not start (its actor could not be placed, its server exited or never answered ``/health``)."""


@dataclass
class _Replica:
    actor: Any = None
    url: str = ""
    generation: int = 0
    serving: bool = False
    error: str | None = None
    restarting: threading.Thread | None = None


class RayReplicas:
    """vLLM server replicas on Ray, health-checked and restarted; what the ``vllm_server`` engine's ``replicas`` is.

    Args:
        settings: ``rollout.ray``.
        model: The checkpoint every replica loads (θ_0; the engine publishes the current θ before a replica serves).
        log_dir: Default directory of the replicas' logs (``settings.log_dir`` wins).
        server_options: ``transport``, ``dtype``, ``max_model_len``, ``lora_rank`` and ``extra`` flags for
            :class:`~tslightning.rollout.vllm_server.ray_replica.ReplicaServer` (``settings.server_args`` follow
            ``extra``).
        role: What the servers are, in their log names (``<role>-<i>-<generation>.log``) and errors: ``replica``
            (the policy's) or ``teacher`` (:func:`launch_teacher`).

    Raises:
        ValueError: One line naming the ``rollout.ray`` setting when Ray is missing, the cluster cannot be reached or
            cannot hold the replicas' resources, or a replica does not start.
    """

    def __init__(
        self,
        settings: RaySettings,
        model: str | Path,
        log_dir: str | Path,
        role: str = "replica",
        **server_options: Any,
    ) -> None:
        self.settings, self.role = settings, role
        extra = [*server_options.pop("extra", []), *settings.server_args]  # later flags win
        self._model, self._options = str(model), {**server_options, "extra": extra}
        self._log_dir = Path(settings.log_dir or log_dir)
        self._ray, self._owns_cluster = _connect(settings)
        self._lock = threading.Condition()
        self._replicas = [_Replica() for _ in range(settings.replicas)]
        self._closed = False
        try:
            _check_resources(self._ray, settings, role)
            for index in range(settings.replicas):  # actors start concurrently; each is then waited for
                self._launch(index)
            for index in range(settings.replicas):
                self._await(index)
        except BaseException as error:
            self.close()
            if isinstance(error, ReplicaFailed):
                raise ValueError(f"rollout.ray: {error}") from None
            raise
        self._monitor = threading.Thread(target=self._watch, name="ray-replica-health", daemon=True)
        self._monitor.start()

    @property
    def urls(self) -> list[str]:
        """Each replica's base URL now (a restarted one gets a new URL)."""
        with self._lock:
            return [replica.url for replica in self._replicas]

    def serving(self) -> dict[int, tuple[int, str]]:
        """Replicas whose server answers now: index → (generation, URL). With ``wait_for_restarts``, waits first for
        the replicas being restarted (``startup_timeout_s`` at most)."""
        with self._lock:
            if self.settings.wait_for_restarts:
                self._lock.wait_for(
                    lambda: self._closed or all(r.restarting is None for r in self._replicas),
                    timeout=self.settings.startup_timeout_s,
                )
            return {i: (r.generation, r.url) for i, r in enumerate(self._replicas) if r.serving}

    def lost(self, index: int, generation: int | None = None) -> None:
        """The engine saw replica ``index`` stop answering: restart it (nothing when already restarting, or when
        ``generation`` is given and the replica was restarted since: its requests to the old server failed)."""
        with self._lock:
            replica = self._replicas[index]
            if self._closed or replica.restarting is not None or generation not in (None, replica.generation):
                return
            replica.serving = False
            replica.restarting = threading.Thread(target=self._restart, args=(index,), daemon=True)
            replica.restarting.start()

    def error(self, index: int) -> str | None:
        """Why replica ``index``'s last restart failed (``None``: it did not)."""
        with self._lock:
            return self._replicas[index].error

    def server_pid(self, index: int) -> int | None:
        """Replica ``index``'s server process id on its node."""
        return self._ray.get(self._replicas[index].actor.pid.remote(), timeout=60)

    def close(self) -> None:
        """Stop every replica's server and actor (and the cluster this launcher started). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        for replica in self._replicas:
            self._stop(replica.actor)
        if self._owns_cluster:
            self._ray.shutdown()

    def _launch(self, index: int) -> None:
        """Start replica ``index``'s actor and its server (not waited for)."""
        from tslightning.rollout.vllm_server.ray_replica import ReplicaServer

        replica = self._replicas[index]
        log = self._log_dir / f"{self.role}-{index}-{replica.generation}.log"
        remote = self._ray.remote(ReplicaServer).options(
            num_cpus=self.settings.num_cpus, num_gpus=self.settings.num_gpus, max_restarts=0
        )
        replica.actor = remote.remote(self._model, self.settings.server_host, str(log), **self._options)
        replica.url = self._ray.get(replica.actor.start.remote(), timeout=self.settings.startup_timeout_s)

    def _await(self, index: int) -> None:
        """Wait until replica ``index`` answers ``/health``; raises :class:`ReplicaFailed` if it cannot."""
        replica = self._replicas[index]
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._ray.get(replica.actor.exit_code.remote(), timeout=60)
            if code is not None:
                tail = self._ray.get(replica.actor.log_tail.remote(), timeout=60)
                raise ReplicaFailed(f"{self.role} {index}'s vLLM server exited with {code}:\n{tail}")
            if answers(replica.url):
                with self._lock:
                    replica.serving, replica.error = True, None
                return
            time.sleep(1.0)
        raise ReplicaFailed(
            f"{self.role} {index} ({replica.url}) did not answer /health within {self.settings.startup_timeout_s} s: "
            "raise rollout.ray.startup_timeout_s, or read its log in rollout.ray.log_dir"
        )

    def _restart(self, index: int) -> None:
        """Replace replica ``index``'s actor and server (a restart thread); a failure is kept in its ``error``."""
        replica = self._replicas[index]
        self._stop(replica.actor)
        try:
            with self._lock:
                if self._closed:
                    return
                replica.generation += 1
            self._launch(index)
            with self._lock:
                closed = self._closed
            if closed:  # closed meanwhile: close() may have missed the new actor
                self._stop(replica.actor)
                return
            self._await(index)
        except Exception as error:  # the others keep serving; the engine fails once none is left
            replica.error = f"{type(error).__name__}: {error}"
        finally:
            with self._lock:
                replica.restarting = None
                self._lock.notify_all()

    def _watch(self) -> None:
        """The health thread: restart each serving replica whose server exited, or that missed
        :data:`MISSES_BEFORE_RESTART` ``/health`` checks in a row (one slow answer on a busy node is no death)."""
        misses: dict[tuple[int, int], int] = {}
        while True:
            with self._lock:
                self._lock.wait(self.settings.health_interval_s)
                if self._closed:
                    return
                serving = [(i, r.generation, r.url, r.actor) for i, r in enumerate(self._replicas) if r.serving]
            for index, generation, url, actor in serving:
                key = (index, generation)
                misses[key] = 0 if answers(url) else misses.get(key, 0) + 1
                if misses[key] >= MISSES_BEFORE_RESTART or (misses[key] and self._exited(actor)):
                    self.lost(index)

    def _exited(self, actor: Any) -> bool:
        """Whether the actor's server exited (or the actor itself is gone)."""
        try:
            return self._ray.get(actor.exit_code.remote(), timeout=30) is not None
        except Exception:
            return True

    def _stop(self, actor: Any) -> None:
        if actor is None:
            return
        try:
            self._ray.get(actor.stop.remote(), timeout=60)
        except Exception:  # the actor (or its node) is gone: its server died with it
            pass
        try:
            self._ray.kill(actor)
        except Exception:
            pass


def launch_teacher(settings: RaySettings, model: str | Path, log_dir: str | Path, **server_options: Any) -> RayReplicas:
    """The frozen OPD teacher (``rollout.ray.teacher``): one vLLM server on ``model`` as a Ray actor holding
    ``teacher_num_cpus`` / ``teacher_num_gpus``, health-checked and restarted like a replica (``teacher-0-<g>.log``).
    Nothing is published to it; its :meth:`RayReplicas.serving` waits for a restart in progress (at most
    ``startup_timeout_s``), so a scorer whose request failed gets the restarted server's URL. Raises like
    :class:`RayReplicas`."""
    teacher = replace(
        settings,
        replicas=1,
        num_cpus=settings.teacher_num_cpus,
        num_gpus=settings.teacher_num_gpus,
        wait_for_restarts=True,
    )
    return RayReplicas(teacher, model, log_dir, role="teacher", **server_options)


def _connect(settings: RaySettings) -> tuple[Any, bool]:
    """Ray, connected to ``settings.address`` (or to a new one-node cluster), and whether this call started the
    cluster (the launcher that did stops it; a second launcher in the same process joins it)."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "rollout.launcher ray needs Ray: pip install -e '.[ray]', or set rollout.launcher none and give "
            "rollout.server_urls"
        ) from None
    if settings.address not in (None, "auto"):
        _check_reachable(settings.address)
    owns = settings.address is None and not ray.is_initialized()
    try:
        if settings.address is None:
            ray.init(include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
        else:
            ray.init(address=settings.address, ignore_reinit_error=True, log_to_driver=False)
    except Exception as error:
        raise ValueError(
            f"rollout.ray.address: cannot connect to the Ray cluster at {settings.address!r} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); run `ray start --head` there, or fix the address"
        ) from None
    return ray, owns


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A GCS ``host:port`` must accept a connection (``ray.init`` would otherwise retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as error:
        raise ValueError(
            f"rollout.ray.address: nothing answers at {address!r} ({type(error).__name__}); run `ray start --head` "
            "there and give its address (host:port), or auto on a node of the cluster"
        ) from None


def _check_resources(ray: Any, settings: RaySettings, role: str = "replica") -> None:
    """The cluster must hold every replica — and the launched teacher — at once (Ray would otherwise wait forever to
    place the last)."""
    total = ray.cluster_resources()
    for name, each in (("CPU", settings.num_cpus), ("GPU", settings.num_gpus)):
        key, have = f"num_{name.lower()}s", float(total.get(name, 0.0))
        if role == "teacher":
            if each > have:
                raise ValueError(
                    f"rollout.ray: the teacher's {each:g} {name}s (rollout.ray.teacher_{key}) are more than the Ray "
                    f"cluster's {have:g}: lower rollout.ray.teacher_{key}, or add nodes"
                )
            continue
        teacher = getattr(settings, f"teacher_{key}") if settings.teacher else 0.0
        need = each * settings.replicas + teacher
        if need > have:
            also = f" + the teacher's {teacher:g} (rollout.ray.teacher_{key})" if settings.teacher else ""
            raise ValueError(
                f"rollout.ray: {settings.replicas} replicas x {each:g} {name}s (rollout.ray.{key}){also} need "
                f"{need:g}, the Ray cluster has {have:g}: lower rollout.ray.{key} or rollout.ray.replicas, or add nodes"
            )
