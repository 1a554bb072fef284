# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · The tokenizer
#
# A model reads and writes integers. The tokenizer turns text into those integers and back, and it
# is the first and last thing every request passes through. minillm's tokenizer is a **byte-level
# BPE** written from scratch in `minillm/tokenizer/`; this notebook takes it apart, holds it to
# Hugging Face `tokenizers` token for token, and measures its speed against it.

# %%
from minillm import notebook as nb

nb.header("01")

# %% [markdown]
# ## 1. Bytes, and a printable spelling for them
#
# Byte-level BPE starts from the 256 possible bytes of UTF-8 text, so no input is ever "unknown".
# Vocabulary files store tokens as text, so each byte gets a printable stand-in: printable Latin-1
# bytes are themselves, the other 68 bytes are shifted above U+0100. A space becomes `Ġ`, a newline `Ċ`.

# %%
# NBVAL_CHECK_OUTPUT
from minillm.tokenizer.byte_level import byte_to_char, spell

table = byte_to_char()
print({hex(b): table[b] for b in [0x0A, 0x20, 0x41, 0x7F, 0xA0, 0xE9]})
print(repr(spell(" café\n".encode())), "<-", list(" café\n".encode()))

# %% [markdown]
# ## 2. Training: the merge loop
#
# Training counts adjacent pairs inside pre-tokenized chunks, makes the most frequent pair a new
# token, and repeats. Here it learns 300 merges from this course's own text samples; watch the
# first merges — spaces before common letters, then whole common words.

# %%
from minillm.tokenizer import samples, train_bpe

text = "\n".join(samples.PROSE + samples.CODE) * 4
small = train_bpe(text, vocab_size=256 + 300, progress=True)
by_rank = sorted(small.merges.items(), key=lambda kv: kv[1][0])
print("first merges:", [small.vocab[new].decode("utf-8", "replace") for _, (_, new) in by_rank[:15]])
print("last merges: ", [small.vocab[new].decode("utf-8", "replace") for _, (_, new) in by_rank[-8:]])

# %% [markdown]
# Each merge shortens the encoded text. The compression curve — bytes per token as the vocabulary
# grows — is why real vocabularies have 32K–256K entries.

# %%
import matplotlib.pyplot as plt

sizes = [256, 266, 286, 326, 406, 556]
big = train_bpe(text, vocab_size=sizes[-1])


def truncated(tok, n_merges):  # the same tokenizer, stopped after its first n merges
    from minillm.tokenizer import Tokenizer

    keep = {p: v for p, v in tok.merges.items() if v[0] < n_merges}
    return Tokenizer(vocab=tok.vocab, merges=keep, pre_tokenizer=tok.pre_tokenizer)


ratios = [len(text.encode()) / len(truncated(big, s - 256).encode(text)) for s in sizes]
nb.plot_lines(sizes, {"bytes per token": ratios}, xlabel="vocabulary size", ylabel="bytes / token",
              title="Each merge compresses the text a little more")
plt.show()

# %% [markdown]
# ## 3. The real thing: SmolLM2's tokenizer from its GGUF file
#
# The embedded model's GGUF header stores 49,152 tokens, 48,900 merges in training order, 17 added
# tokens (`<|im_start|>`, `<|im_end|>`, …) and a ChatML template. `load_tokenizer()` reads them.

# %%
import minillm

tok = minillm.load_tokenizer()
print(tok)
print("eos:", tok.eos_token, tok.eos_token_id, "| special:", list(tok.special_tokens)[:4], "…")

# %% [markdown]
# Encoding a chunk replays the merges: start with one token per byte and keep joining the adjacent
# pair that was learned earliest (lowest rank). Here is the loop, step by step, for one word:

# %%
# NBVAL_CHECK_OUTPUT
from minillm.tokenizer import merge_pair

ids = tok.bytes_to_ids(b" tokenization")
while True:
    ranked = [(tok.merges[p][0], p) for p in zip(ids, ids[1:]) if p in tok.merges]
    print(f"{[tok.id_to_token(i) for i in ids]}")
    if not ranked:
        break
    rank, pair = min(ranked)
    ids = merge_pair(ids, pair, tok.merges[pair][1])
assert ids == tok.encode(" tokenization")

# %% [markdown]
# Before BPE, a regular expression cuts the text into chunks that merges never cross: words with
# their leading space, numbers, runs of punctuation, and whitespace (keeping the last space for the
# next word).

# %%
# NBVAL_CHECK_OUTPUT
print(tok.pre_tokenizer.split("Hello world!  It's 2026: naïve café, 東京 😀\n\n  def f(x):"))

# %% [markdown]
# ## 4. The oracle: HF `tokenizers`, token for token
#
# transformers builds HF's Rust tokenizer from the **same GGUF file**; any difference would be a
# difference in the algorithm. We compare on the fixed samples (prose, code, numbers, whitespace
# runs, emoji and ZWJ sequences, many scripts, combining marks, added tokens) and on fresh random
# Unicode, and check that every text round-trips.

# %%
import random

import transformers
from transformers import AutoTokenizer

from minillm.model_files import embedded_model_path

transformers.logging.set_verbosity_error()
path = embedded_model_path()
hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

texts = samples.FIXED + samples.random_texts(random.SystemRandom().randrange(2**31), n=800)
# Bytes SmolLM2's vocabulary lacks: minillm drops them (like llama.cpp); transformers 5.23 does too,
# 5.17 maps them to <|endoftext|>. Where HF maps them, compare on the texts without those bytes.
hf_drops = hf.encode("a\x04b") == tok.encode("a\x04b")
comparable = texts if hf_drops else ["".join(c for c in t if tok.covers(c)) for t in texts]
mismatches = [t for t in comparable if tok.encode(t) != hf.encode(t)]
assert not mismatches, mismatches[:3]
assert all(tok.decode(tok.encode(t)) == t for t in comparable if tok.covers(t))
print(f"transformers {transformers.__version__}: bytes with no token are "
      f"{'dropped, as in minillm' if hf_drops else 'mapped to <|endoftext|> (minillm drops them)'}; "
      f"{sum(not tok.covers(t) for t in texts)} random texts hold such bytes")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{len(comparable)} texts: {len(comparable) - len(mismatches)} identical to HF tokenizers, {len(mismatches)} different")

# %% [markdown]
# Two honest caveats, both tested in `tests/test_tokenizer_parity.py`:
#
# * SmolLM2's vocabulary has no token for a few bytes (six control characters, and bytes of code
#   points in unassigned planes). llama.cpp and transformers 5.23 drop them, and so do we, so those
#   texts cannot round-trip — `tok.covers(text)` says whether one can. transformers 5.17 maps them to
#   the unk token instead; with `unk_token_id` set, minillm does that too (tested against both).
# * The pattern's `\p{L}` depends on the Unicode version of the regex engine. A code point assigned
#   only in the newest Unicode is a letter to Python's `regex` and unassigned to HF's; random tests
#   avoid such characters.
#
# ## 5. Chat template
#
# An instruct model was trained on conversations in one exact format. The template lives in the GGUF
# header; we render it with Jinja2 as transformers does, and the result must equal HF's.

# %%
# NBVAL_CHECK_OUTPUT
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
assert prompt == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
print(prompt)
print(tok.encode(prompt))

# %% [markdown]
# ## 6. Streaming: the incremental detokenizer
#
# A server streams text as tokens arrive. But a byte-level token can end in the middle of a
# character: decoding tokens one by one prints `�` garbage. The incremental detokenizer holds back
# the bytes of an unfinished character and emits text only at UTF-8 boundaries.

# %%
# NBVAL_CHECK_OUTPUT
from minillm.tokenizer import IncrementalDetokenizer

text = "Grüße! 東京 😀👩‍👩‍👧"
ids = tok.encode(text)
naive = [tok.decode([i]) for i in ids]
detok = IncrementalDetokenizer(tok)
streamed = [detok.step(i) for i in ids] + [detok.flush()]
print("token by token:", naive)
print("incremental:   ", streamed)
assert "".join(streamed) == text and "\ufffd" not in "".join(streamed)

# %% [markdown]
# ## 7. Speed: minillm vs HF `tokenizers`
#
# Both encode the same ~2 MB of real text (Python's standard library sources: code and English
# docstrings) on one thread. Ours is Python: a regex pre-tokenizer and a cache of already-encoded
# chunks in front of the merge loop. HF's is Rust. "Cold" clears our cache before the run, so every
# distinct chunk goes through the merge loop once.

# %%
from minillm.bench import tokenizer as bench_tok

rows = bench_tok.run(n_chars=nb.pick(cpu=500_000, gpu=2_000_000))
nb.plot_bars([r["tokenizer"] for r in rows], [r["MB_per_s"] for r in rows], ylabel="MB/s",
             title="encode throughput, one thread (higher is better)")
plt.show()
hf_speed = rows[-1]["MB_per_s"]
for r in rows[:-1]:
    print(f"{r['tokenizer']}: {r['MB_per_s'] / hf_speed:.2f}x HF tokenizers' throughput")

# %% [markdown]
# Real text repeats its words, so after the first few thousand chunks almost every chunk is a cache
# hit and the cost is the regex and the dictionary lookups. The merge loop itself is slow in Python
# (see the lab: it is $O(n^2)$ per chunk), but it only runs on chunks never seen before.
