"""Config of the ``orchestrator`` process."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Self

from pydantic import Field, field_validator, model_validator

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.config.base import BaseConfig
from prime_composer.config.client import RetryConfig
from prime_composer.config.common import CommonConfig
from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.config.sections import ChannelSections

MIN_TRAIN_TOP_P = 0.05
WEIGHTS_LOAD_RETRY = RetryConfig(timeout_s=600.0, max_retries=3)
"""Smallest nucleus for training rollouts (below it the rollouts of a group are all alike)."""


class EvalConfig(BaseConfig):
    """Held-out evaluation during training (environments with ``eval_args``)."""

    interval: int = Field(default=5, ge=0)
    """Evaluate every this many steps (and after the last one); 0 turns evaluation off."""

    at_start: bool = True
    """Also evaluate the initial policy, before step 0."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature for evaluation; 0 is greedy."""


class ReplaySourceConfig(BaseConfig):
    """The replay channel's side of the orchestrator: DPO pairs from the teacher service's store,
    mixed into every batch (the loss side is ``trainer.loss.replay``; both must be on together)."""

    enabled: bool = False
    """Mix pairs into batches."""

    store: Path | None = None
    """The teacher service's SQLite store; None: ``<output_dir>/teacher/teacher.sqlite``."""

    pairs_per_step: int = Field(default=8, ge=1)
    """Pairs taken per step (fewer when fewer are ready; none is reused), in ``order``."""

    order: Literal["oldest", "newest"] = "oldest"
    """``oldest``: every pair in turn, oldest first. ``newest``: the ``pairs_per_step`` newest ready
    pairs; older ones not taken yet are skipped for good (counted in ``replay/pairs_stale``)."""

    heldout_pairs: int = Field(default=0, ge=0)
    """The first this many ready pairs are a held-out set, never trained on: every
    ``heldout_every`` steps they ride along in the batch and the trainer logs TRL's DPO metrics on
    them (``dpo_heldout/accuracy``, ``/margin``, ``/chosen_reward``, ``/rejected_reward``, ``/loss``)."""

    heldout_every: int = Field(default=10, ge=1)
    """Steps between two scorings of the held-out pairs (step 0 and every multiple)."""

    max_pair_age: int | None = Field(default=None, ge=0)
    """Skip pairs that have been ready for more than this many steps (counted in
    ``replay/pairs_stale``): with pairs arriving faster than ``pairs_per_step`` take them, the
    ones trained stay this fresh. None takes every pair in turn."""

    send_traces: bool = True
    """Post each step's rollouts to the teacher service as traces to replay (when ``rl`` runs one)."""

    teacher_url: str | None = None
    """The teacher service's address (``rl`` sets it from ``[teacher]``); None sends no traces."""

    teacher_secret_env: str | None = None
    """Name of the variable with the teacher service's secret (``rl`` copies ``teacher.secret_env``)."""

    retry: RetryConfig = RetryConfig(timeout_s=30.0, max_retries=2)
    """Timeouts and retries of the trace posts to the teacher service (``teacher/client.py``)."""


class FailureConfig(BaseConfig):
    """When the orchestrator stops the run instead of training on (almost) nothing."""

    max_error_fraction: float = Field(default=1.0, gt=0, le=1)
    """Stop the run when at least this fraction of a step's rollouts failed (1.0: only when every
    one did). Failed rollouts are recorded and left out either way."""

    max_empty_steps: int = Field(default=3, ge=1)
    """Stop the run after this many steps in a row with no sample to train on (every group failed,
    had equal rewards, or was too stale)."""


class ReplicasConfig(BaseConfig):
    """How the orchestrator treats several inference servers (``base_url`` as a list): when one is
    taken out and how it is brought back (``orchestrator/replicas.py``)."""

    max_failures: int = Field(default=3, ge=1)
    """Failed calls in a row (connection refused or reset, timeout, 5xx) after which a replica is
    taken out; a call that succeeds resets the count. A replica that fails to load new weights is
    taken out at once (it cannot serve the current policy)."""

    retry_s: float = Field(default=5.0, gt=0)
    """Seconds between health checks of a replica that was taken out; it serves again once its
    ``/health`` answers and it has loaded the current weights."""

    request_timeout_s: float = Field(default=600.0, gt=0)
    """Time limit of one relayed call; a replica past it counts one failure and the call is sent
    to another."""

    wait_s: float = Field(default=60.0, ge=0)
    """How long a call waits for a replica that serves the current weights when none does (all
    taken out) before it fails (and its rollout becomes an error sample)."""


class OrchestratorConfig(CommonConfig, ChannelSections):
    """The orchestrator: samples rollouts, scores them, computes advantages, packs batches (and a
    registered plugin channel's ``orchestrator.<name>`` section: ``config/sections.py``)."""

    channel_kind: ClassVar[Literal["loss", "orchestrator"]] = "orchestrator"

    base_url: str | list[str] = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible endpoint of the inference server (the ``rl`` launcher sets it), or a list
    of several replicas of it (PRIME-RL's ``client.base_url`` list): rollouts go to the replica with
    the fewest calls in flight among those that serve the current weights, every weight update goes
    to all of them, and a replica that fails is taken out and retried (``replicas``)."""

    replicas: ReplicasConfig = ReplicasConfig()
    """When a replica of a ``base_url`` list is taken out and brought back."""

    inference_secret_env: str | None = None
    """Name of the environment variable with the inference server's admin secret, sent with
    weight updates (the ``rl`` launcher copies ``inference.secret_env``)."""

    # --- TLS to the inference servers (client/tls.py; the servers' inference.tls_cert) ---
    inference_tls_fingerprint: str | None = None
    """For ``https://`` servers of ``base_url``: the SHA-256 fingerprint of their certificate
    (``sha256:<64 hex>``, printed by ``python -m prime_composer.wire.tls``), checked after the
    handshake and before anything is sent; another certificate is refused. Rollouts then go through
    the replica relay on loopback, which checks it too."""

    inference_tls_ca: Path | None = None
    """For ``https://`` servers of ``base_url``: a PEM file of the CA certificates their
    certificates must chain to (hostnames checked). Neither this nor the fingerprint: the system's
    CAs. Not both."""

    inference_private_network: bool = False
    """The links to the inference servers are already private (a VPN, a cluster fabric): an
    ``http://`` server of ``base_url`` off loopback is allowed. Without it such a server is refused
    (prompts, completions and weight-update calls would cross the network in the clear): serve it
    with ``inference.tls_cert`` and list it as ``https://``."""

    @field_validator("inference_tls_fingerprint")
    @classmethod
    def _normalized_pin(cls, value: str | None) -> str | None:
        from prime_composer.config.diloco import normalize_fingerprint

        if value is None:
            return None
        try:
            return normalize_fingerprint(value)
        except ValueError as e:
            raise ValueError(f"orchestrator.inference_tls_fingerprint: {e}") from None

    @model_validator(mode="after")
    def _check_inference_tls(self) -> Self:
        if self.inference_tls_fingerprint is not None and self.inference_tls_ca is not None:
            raise ValueError(
                "orchestrator.inference_tls_fingerprint and orchestrator.inference_tls_ca are both set: "
                "pin the servers' certificate or name a CA, not both"
            )
        pinned = self.inference_tls_fingerprint is not None or self.inference_tls_ca is not None
        if pinned and not any(url.startswith("https://") for url in self.server_urls):
            raise ValueError(
                "orchestrator.inference_tls_fingerprint / inference_tls_ca are set but no "
                f"orchestrator.base_url is https:// ({self.server_urls}); serve the inference servers "
                "with inference.tls_cert / tls_key and list them as https://"
            )
        from urllib.parse import urlsplit

        from prime_composer.netaddr import is_loopback

        for url in self.server_urls:
            parts = urlsplit(url)
            if (
                parts.scheme == "http"
                and not is_loopback(parts.hostname or "")
                and not self.inference_private_network
            ):
                raise ValueError(
                    f"orchestrator.base_url: {url} is plain HTTP to another machine: serve it with "
                    "inference.tls_cert / tls_key (`rl certs --out DIR --host <address>`), list it as https:// "
                    "and pin it (orchestrator.inference_tls_fingerprint), or set "
                    "orchestrator.inference_private_network = true if the link is already private"
                )
        return self

    env: list[EnvConfig] = Field(default_factory=list)
    """The environments to train on: one ``[[orchestrator.env]]`` table each."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters of every rollout request."""

    rollout: RolloutConfig = RolloutConfig()
    """Concurrency, retries and time limits of rollouts."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage computation and dynamic sampling."""

    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""

    sdpo: HintConfig = HintConfig()
    """SDPO hints: which failed rollouts get a hinted teacher context (needs
    ``trainer.loss.sdpo.weight > 0``)."""

    batch_size: int = Field(default=32, ge=1)
    """Samples (rollouts) per training step; a multiple of ``group_size``."""

    group_size: int = Field(default=8, ge=1)
    """Rollouts per example; advantages are computed within each group."""

    seq_len: int = Field(default=512, ge=16)
    """Length of each packed row in tokens; longer samples are truncated."""

    micro_batch_size: int = Field(default=4, ge=1)
    """Packed rows per trainer forward/backward pass."""

    num_train_ranks: int = Field(default=1, ge=1)
    """Trainer ranks to pack for (the ``rl`` launcher copies ``trainer.num_ranks``)."""

    max_off_policy_steps: int = Field(default=8, ge=0)
    """Drop samples generated with weights more than this many steps older than the batch."""

    max_refill_rounds: int = Field(default=8, ge=0)
    """Groups that cannot be trained on (rewards all equal under dynamic sampling, every rollout
    failed, too stale) are replaced by new ones; a step consumes at most ``(1 + max_refill_rounds)
    x batch_size / group_size`` groups, then trains on what it has."""

    max_inflight: int | None = Field(default=None, ge=1)
    """Rollouts launched and not yet finished, across steps (queued ones included); groups for the
    next steps start while the current step's slowest finish. None: ``batch_size x
    (max_async_level + 1)``. Must hold at least one group (``group_size``)."""

    replay: ReplaySourceConfig = ReplaySourceConfig()
    """The replay channel: pairs from the teacher service mixed into every batch."""

    failure: FailureConfig = FailureConfig()
    """When a run that trains on nothing stops with an error instead of reporting success."""

    weights_poll_s: float = Field(default=0.1, gt=0)
    """How often to look for newly published weights while waiting for them."""

    weights_timeout_s: float = Field(default=3600.0, gt=0)
    """Give up (exit with an error) if the weights a step needs do not appear within this time."""

    weights_load_retry: RetryConfig = WEIGHTS_LOAD_RETRY
    """Timeouts and retries of each ``/update_weights`` call to an inference server: loading a
    large model can take minutes, so one attempt may run 10 min; a refused connection (the server
    restarting) is retried, a refusal (4xx) is final."""

    @property
    def server_urls(self) -> list[str]:
        """``base_url`` as a list (one element for a single server)."""
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    @model_validator(mode="after")
    def _check(self) -> Self:
        urls = self.server_urls
        if not urls:
            raise ValueError(
                "orchestrator.base_url = []: give the inference server's URL (or a list of several)"
            )
        if len(set(urls)) != len(urls):
            raise ValueError(
                f"orchestrator.base_url = {urls}: a server is listed twice; list each replica once"
            )
        if self.batch_size % self.group_size:
            raise ValueError(
                f"orchestrator.batch_size ({self.batch_size}) must be a multiple of orchestrator.group_size "
                f"({self.group_size}): every step trains on whole groups (e.g. batch_size = "
                f"{max(1, self.batch_size // self.group_size) * self.group_size})"
            )
        if self.group_size < 2:
            raise ValueError(
                "orchestrator.group_size = 1: advantages are relative to the other rollouts of a group, so "
                "every sample would get advantage 0 and nothing would be learned; use group_size >= 2"
            )
        if self.sampling.temperature == 0:
            raise ValueError(
                "orchestrator.sampling.temperature = 0 (greedy) gives no distribution to compute the "
                "policy-gradient ratios with; train with temperature > 0 (greedy evaluation is "
                "orchestrator.eval.temperature)"
            )
        if self.sampling.top_p < MIN_TRAIN_TOP_P:
            raise ValueError(
                f"orchestrator.sampling.top_p = {self.sampling.top_p} samples (nearly) greedily and every "
                f"group's rollouts would be the same; use top_p >= {MIN_TRAIN_TOP_P} (1.0 samples the policy)"
            )
        if self.max_inflight is not None and self.max_inflight < self.group_size:
            raise ValueError(
                f"orchestrator.max_inflight = {self.max_inflight} cannot hold one group of "
                f"group_size = {self.group_size} rollouts: raise it to at least {self.group_size}"
            )
        return self
