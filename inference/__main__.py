"""`python -m inference chat "question"` prints the model's greedy reply to one user message."""
import argparse
import logging
import sys

from inference.engine import Engine
from inference.kv_cache import cdiv
from inference.threads import torch_threads_apply
from inference.sequence import SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="greedy reply to one user message")
    chat.add_argument("message")
    chat.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch_threads_apply()
    engine = Engine.from_env(num_pages=max(64, cdiv(args.max_tokens + 2048, 16)))
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.message}])
    (seq,) = engine.generate([ids], SamplingParams(max_tokens=args.max_tokens))
    print(seq.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
