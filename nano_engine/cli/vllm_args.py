"""`python -m nano_engine vllm-args [serve's flags]`: the vLLM command that serves the same model
with the same settings (lab/vllm_bridge.py maps the settings)."""

from __future__ import annotations

import shlex

from ..lab.vllm_bridge import hf_folder, vllm_command
from .common import guarded
from .serve import build_parser, engine_config, served_name


def main(argv=None) -> int:
    """`python -m nano_engine vllm-args [serve's flags]`: print the vLLM command for the same settings."""
    ap = build_parser()
    ap.prog = "python -m nano_engine vllm-args"
    ap.description = "Print the vLLM command line that serves the same model with the same settings."

    def run(ap, args) -> int:
        from ..models.loading import resolve_model_path

        if args.quantization:  # vLLM's own --quantization methods are other formats (a checkpoint's)
            ap.error(f"--quantization {args.quantization} has no vLLM counterpart: vLLM quantizes from "
                     "checkpoints made for it, not the float weights at load")
        try:
            cmd = vllm_command(engine_config(args), str(hf_folder(resolve_model_path(args.model))), dtype=args.dtype,
                               max_model_len=args.max_model_len, host=args.host, port=args.port,
                               served_model_name=served_name(args), api_key=args.api_key)
        except ValueError as e:
            ap.error(str(e))
        print(shlex.join(cmd))
        return 0

    return guarded(ap, argv, run)
