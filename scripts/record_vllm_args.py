"""Record vLLM's engine-argument names and its OpenAI server's flags, for tests/test_vllm_bridge.py.

Run with vLLM's Python (`make vllm` first):
    .venv-vllm/bin/python scripts/record_vllm_args.py tests/data/vllm_0.32.0_args.json
    .venv-vllm/bin/python scripts/record_vllm_args.py -        # to stdout (the test does this)
"""

import dataclasses
import importlib
import json
import sys


def parser_class():
    for module in ("vllm.utils.argparse_utils", "vllm.utils"):  # where FlexibleArgumentParser lives, by version
        try:
            return importlib.import_module(module).FlexibleArgumentParser
        except (ImportError, AttributeError):
            continue
    raise ImportError("FlexibleArgumentParser not found in this vLLM")


def main(out: str) -> None:
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    try:  # where the OpenAI server's parser lives, by version
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser(parser_class()(description="vLLM OpenAI-compatible server"))
    flags = sorted({s for action in parser._actions for s in action.option_strings if s.startswith("--")})
    data = {"vllm_version": vllm.__version__, "engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
            "flags": flags}
    text = json.dumps(data, indent=1) + "\n"
    if out == "-":
        sys.stdout.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "-")
