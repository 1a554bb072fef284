"""The `minillm` command.

Ending: a bad argument or model is one line on stderr and exit 2. `minillm chat` ends on an empty
line, at the end of its input (Ctrl-D, or stdin closed) and on Ctrl-C, each with exit 0; a line that
is not valid UTF-8 is skipped with a note on stderr. Ctrl-C in the other commands exits 130. When the
reader of stdout goes away (`minillm chat | head`), the command stops silently with exit 141, as a C
tool killed by SIGPIPE does. None of these prints a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .entrypoints.openai.cli_args import (  # plain argparse: no server package is imported
    add_kv_eviction_args,
    kv_eviction_kwargs,
    positive_int,
)


def _tokenize(args) -> int:
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    text = args.text
    if args.chat:
        messages = [{"role": "user", "content": text}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        print(f"chat prompt ({tok.name}'s template):\n{text}")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # content as plain text
    else:
        ids = tok.encode(text)
    print(f"{len(ids)} tokens ({len(text.encode())} bytes, {len(text.encode()) / max(1, len(ids)):.2f} bytes/token)")
    if not args.ids_only:
        print(f"{'id':>7}  {'vocab entry':<20} text")
        for i in ids:
            print(f"{i:>7}  {tok.id_to_token(i):<20} {tok.decode([i])!r}")
    print("ids:", ids)
    if not tok.covers(text):
        print(f"note: bytes {sorted(set(text.encode()) & set(tok.uncovered_bytes))} have no token and were dropped")
    return 0


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)


def _load(args):
    from .llm import LLM

    # generate and chat stream one request at a time: a decode graph for batch 1 is all they replay,
    # and capturing one graph instead of twenty keeps start-up short on a GPU; each prompt is one
    # prefill step, cheaper run eagerly than captured for a single use
    kv = kv_eviction_kwargs(args)
    if kv.get("kv_offload_gb") or kv.get("kv_offload_blocks"):  # the tier is the prefix cache's second level
        kv["enable_prefix_caching"] = "hash"
    return LLM(args.model, dtype=args.dtype, device=args.device, cuda_graph_max_batch=1, cuda_graph_max_tokens=0,
               kv_cache_dtype=args.kv_cache_dtype, quantization=_quantization(args),
               speculative_config=_speculative(args), tensor_parallel_size=args.tensor_parallel_size, **kv)


def _speculative(args):
    from .spec_decode.config import from_cli_args

    return from_cli_args(args)


def _quantization(args):
    from .quantize import parse_quantization

    return parse_quantization(args.quantization)


def _chat_ids(llm, messages) -> dict:
    """The conversation as token ids, its contents as plain text: a user typing "<|im_end|>" stays a user."""
    return {"prompt_token_ids": llm.tokenizer.apply_chat_template(messages, tokenize=True)}


def _stream(llm, prompt, params) -> str:
    import time

    start, text = time.perf_counter(), ""
    for piece in llm.stream(prompt, params):
        print(piece, end="", flush=True)
        text += piece
    seconds = time.perf_counter() - start
    n = len(llm.tokenizer.encode(text))
    print(flush=True)
    how = "no KV cache" if llm.engine is None else "paged KV cache"
    print(f"[{n} tokens in {seconds:.1f} s: {n / seconds:.1f} tok/s, {llm.device}, {how}]", file=sys.stderr)
    if llm.engine is not None and llm.engine.proposer is not None:  # chapter 09: the drafts' acceptance so far
        print(f"[{llm.engine.engine_stats.spec.summary()}]", file=sys.stderr)
    return text


def _generate(args) -> int:
    params = _sampling(args)  # a bad --temperature or --top-p fails before the model loads
    llm = _load(args)
    prompt = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = _chat_ids(llm, [{"role": "user", "content": prompt}])
    _stream(llm, prompt, params)
    return 0


def _chat(args) -> int:
    if sys.stdin is None:  # started with stdin closed (`minillm chat <&-`): nothing to read
        print("minillm chat: stdin is closed, nothing to read", file=sys.stderr)
        return 0
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not text arrive as lone surrogates, checked below
        sys.stdin.reconfigure(errors="surrogateescape")
    params, messages = _sampling(args), []  # a bad flag fails before the model loads
    llm = _load(args)
    print(f"chatting with {llm.config.name} on {llm.device} (an empty line, Ctrl-D or Ctrl-C ends)", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()  # end the "you> " line
                break
            if not _is_text(line):
                print("minillm chat: that line is not valid UTF-8 text; skipped it, type it again", file=sys.stderr)
                continue
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            reply = _stream(llm, _chat_ids(llm, messages), params)
            messages.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def _is_text(line: str) -> bool:
    try:
        line.encode("utf-8")  # a lone surrogate (an undecodable byte, kept by surrogateescape) fails
        return True
    except UnicodeEncodeError:
        return False


def _labs(args) -> int:
    from .labs.student import build_student_labs

    written = build_student_labs(args.src, args.out)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"no solution labs (with ### BEGIN SOLUTION markers) in {args.src}")
        return 1
    return 0


def _labs_stale(args) -> int:
    from pathlib import Path

    from . import course_status

    repo = Path(args.repo)
    rows = course_status.course_status(repo)
    if args.write:
        course_status.write(repo, [Path(f) for f in args.write], rows)
        for f in args.write:
            print(f"wrote the outputs status into {f}")
    print(course_status.markdown(rows) if args.markdown else "\n".join(
        f"{s.chapter.number}  {s.chapter.notebook or '-':32} {s.words}" for s in rows))
    listed = [s for s in rows if s.state in ("stale", "unknown")]
    counts = {state: sum(s.state == state for s in rows) for state in ("current", "stale", "unknown")}
    print(", ".join(f"{n} {state}" for state, n in counts.items()) + (
        f": re-run {', '.join(s.chapter.notebook for s in listed)}" if listed else ""))
    return 1 if args.check and listed else 0


def _bench(args) -> int:
    from .bench import WORKLOADS, main

    if args.name == "list":
        for name, (_, what) in WORKLOADS.items():
            print(f"{name:12} {what}")
        return 0
    main(args.name, args.options)  # the workload's own options, parsed by minillm.bench.main
    return 0


def _serve(args) -> int:
    try:
        from .entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as e:
        raise ValueError(f"`minillm serve` needs {e.name}: pip install 'minillm[serve]'") from None
    return run_server(args)


def _router(args) -> int:
    try:
        from .entrypoints.router import run_router
    except ModuleNotFoundError as e:
        raise ValueError(f"`minillm router` needs {e.name}: pip install 'minillm[serve]'") from None
    return run_router(args)


QUANTIZATION_HELP = ("weights in fewer bits: int8, int4, awq, gptq (NAME:key=value,... for options, e.g. "
                     "awq:group_size=64), or a folder written by `minillm quantize`")


def _eval_perplexity(args) -> int:
    import json

    from .data import load_corpus
    from .eval import perplexity
    from .llm import LLM

    if args.corpus is not None:  # a path the user typed: never a place to download into
        path = Path(args.corpus).expanduser()
        if path.is_dir():
            raise ValueError(f"--corpus {path} is a folder; give the corpus text file (or leave --corpus out: "
                             f"minillm fetches it once to ~/.cache/minillm/)")
        if not path.is_file():
            raise ValueError(f"--corpus {path} does not exist; give an existing corpus file (or leave --corpus out: "
                             f"minillm fetches it once to ~/.cache/minillm/)")
    _quantization(args)  # a bad --quantization fails now, before the corpus and the model load
    corpus = load_corpus(args.corpus, download=args.corpus is None)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, enable_kv_cache=False,
              quantization=_quantization(args))
    text = corpus.eval_text() if args.split == "eval" else corpus.calibration_text()
    r = perplexity(llm, text, context_len=args.context_len, stride=args.stride, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps({"model": llm.config.name, "quantization": args.quantization, "split": args.split,
                          "dtype": str(llm.dtype).removeprefix("torch."), "device": str(llm.device), **r.as_dict()}))
    else:
        print(f"perplexity {r.perplexity:.3f} (nll {r.nll:.4f} nats/token) over {r.num_tokens} tokens of the "
              f"{args.split} split; {llm.config.name}, quantization {args.quantization or 'none'}, windows of "
              f"{r.context_len} every {r.stride}, {llm.dtype}, {llm.device}")
    return 0


def _quantize(args) -> int:
    from .llm import _device, _dtype
    from .quantize import check_out, quantize_model

    check_out(args.out, args.model, args.overwrite)  # before anything loads: never write into the model
    device = _device(args.device)
    options = {k: v for k, v in (("group_size", args.group_size), ("num_sequences", args.num_sequences),
                                 ("seq_len", args.seq_len)) if v is not None}
    if args.method in ("int4", "awq", "gptq") and "group_size" not in options:
        options["group_size"] = _default_group_size(args.model)
    if args.method == "int8" and len(options):
        raise ValueError(f"--method int8 takes no {', '.join('--' + k.replace('_', '-') for k in options)}")
    if args.method == "int4" and set(options) - {"group_size"}:
        raise ValueError("--method int4 (round to nearest) takes no calibration options")
    if args.act_order:
        if args.method != "gptq":
            raise ValueError("--act-order is a gptq option")
        options["act_order"] = True
    out = quantize_model(args.model, args.method, options, args.out, dtype=_dtype(args.dtype, device), device=device,
                         overwrite=args.overwrite)
    print(f"wrote {out} ({args.method}, {options})")
    return 0


def _default_group_size(model) -> int:
    """128 where it divides every linear layer's input size, else 64 (SmolLM2's 576), else 32."""
    from .loader import read_model_config

    c = read_model_config(model)
    sizes = {c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim}
    return next((g for g in (128, 64) if all(k % g == 0 for k in sizes)), 32)


def build_parser() -> argparse.ArgumentParser:
    from .spec_decode.config import add_cli_args as add_speculative_args

    p = argparse.ArgumentParser(prog="minillm", description="minillm: an LLM inference engine you can read.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tokenize", help="show how a model's tokenizer cuts a text")
    t.add_argument("text")
    t.add_argument("--model", default=None, help="a .gguf file, tokenizer.json or HF model folder (default: embedded SmolLM2)")
    t.add_argument("--chat", action="store_true", help="wrap the text as a user turn with the model's chat template")
    t.add_argument("--ids-only", action="store_true", help="print only the ids")
    t.set_defaults(fn=_tokenize)

    for name, helptext in [("generate", "generate a reply to a prompt, streamed"), ("chat", "chat in the terminal")]:
        g = sub.add_parser(name, help=helptext)
        if name == "generate":
            g.add_argument("prompt")
            g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
        g.add_argument("--model", default=None, help="a .gguf file, HF model folder or hub id (default: embedded SmolLM2)")
        g.add_argument("--max-tokens", type=positive_int, default=128)
        g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
        g.add_argument("--top-p", type=float, default=0.9)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        g.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
        g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "int8"],
                       help="KV cache storage: auto (the model's dtype), fp8 (e4m3) or int8 with calibrated scales")
        g.add_argument("--quantization", default=None, help=QUANTIZATION_HELP)
        g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="split the model over N GPUs (or N CPU processes), one worker process each (chapter 11)")
        add_speculative_args(g)
        add_kv_eviction_args(g)
        g.set_defaults(fn=_generate if name == "generate" else _chat)

    labs = sub.add_parser("labs", help="lab notebooks")
    labs_sub = labs.add_subparsers(dest="labs_command", required=True)
    b = labs_sub.add_parser("build", help="write the student notebooks from the solution labs")
    b.add_argument("--src", default="notebooks/labs")
    b.add_argument("--out", default=None, help="default: SRC/student")
    b.set_defaults(fn=_labs)
    st = labs_sub.add_parser("stale", help="per chapter: are the notebook's stored outputs those of today's modules?")
    st.add_argument("--repo", default=".", help="the repository checkout (default: here)")
    st.add_argument("--markdown", action="store_true", help="print the course map's status table")
    st.add_argument("--write", nargs="+", metavar="FILE", help="rewrite the outputs-status block of these files")
    st.add_argument("--check", action="store_true", help="exit 1 if a notebook is stale or unknown")
    st.set_defaults(fn=_labs_stale)

    from .entrypoints.openai.cli_args import add_router_args, add_serve_args

    serve = sub.add_parser("serve", help="serve a model over HTTP with the OpenAI API (needs minillm[serve])")
    add_serve_args(serve)
    serve.set_defaults(fn=_serve)

    router = sub.add_parser("router", help="one OpenAI endpoint over a prefill and a decode server (chapter 17)")
    add_router_args(router)
    router.set_defaults(fn=_router)

    ev = sub.add_parser("eval", help="measure a model's quality")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = ev_sub.add_parser("perplexity", help="perplexity on the held-out Wikipedia articles (chapter 08)")
    ppl.add_argument("--model", default=None, help="a .gguf file, HF model folder or hub id (default: embedded SmolLM2)")
    ppl.add_argument("--quantization", default=None, help=QUANTIZATION_HELP)
    ppl.add_argument("--max-tokens", type=positive_int, default=4096, help="score the first N tokens of the text (default 4096)")
    ppl.add_argument("--context-len", type=positive_int, default=None, help="window length (default: min(model's, 1024))")
    ppl.add_argument("--stride", type=positive_int, default=None, help="how far each window moves (default: context-len / 2)")
    ppl.add_argument("--corpus", default=None, help="the cached corpus text file (default: $MINILLM_CORPUS or "
                     "~/.cache/minillm/, fetched once)")
    ppl.add_argument("--split", default="eval", choices=["eval", "calibration"], help="which part of the corpus")
    ppl.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ppl.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    ppl.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    ppl.set_defaults(fn=_eval_perplexity)

    qz = sub.add_parser("quantize", help="quantize a model (AWQ/GPTQ calibrate on the corpus) and save it")
    qz.add_argument("--model", default=None, help="a .gguf file, HF model folder or hub id (default: embedded SmolLM2)")
    qz.add_argument("--method", required=True, choices=["awq", "gptq", "int4", "int8"])
    qz.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None, help="int4/awq/gptq group (32, 64, 128; default 128, "
                    "or 64 where 128 does not divide the layers, as for SmolLM2's 576)")
    qz.add_argument("--num-sequences", type=positive_int, default=None, help="calibration sequences (awq/gptq)")
    qz.add_argument("--seq-len", type=positive_int, default=None, help="tokens per calibration sequence (awq/gptq)")
    qz.add_argument("--act-order", action="store_true", help="gptq: round the most used inputs first")
    qz.add_argument("--out", required=True, help="the folder to write (quant_config.json, model.safetensors): a "
                    "new or empty folder outside the model's")
    qz.add_argument("--overwrite", action="store_true", help="replace --out if it is a folder an earlier `minillm quantize` wrote (any other non-empty folder is refused)")
    qz.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    qz.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    qz.set_defaults(fn=_quantize)

    td = sub.add_parser("train-drafter", help="self-distil Medusa heads or an EAGLE layer for a model (chapter 09)")
    from .entrypoints import train_drafter as _td  # the command's own flags

    _td.add_arguments(td)
    td.set_defaults(fn=_td.main)

    bench = sub.add_parser("bench", help="run a named benchmark ('list' to see them)")
    bench.add_argument("name")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the workload's options ('NAME --help' lists them)")
    bench.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:  # ImportError: an optional package missing
        print(f"minillm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the chat loop, or in another command
        print(file=sys.stderr)
        return 0 if args.fn is _chat else 130
    except BrokenPipeError:  # the reader of stdout went away: stop quietly
        _silence_stdout()
        return 141


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit does not raise BrokenPipeError again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
