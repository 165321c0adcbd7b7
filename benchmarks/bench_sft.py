#!/usr/bin/env python
"""The closing figures of supervised fine-tuning (issue 47), printed one per line:

1. tokenizer parity: k3train's tiktoken tokenizer (a Kimi-style ``tiktoken.model`` + ``tokenizer_config.json`` built
   from the shipped BPE's merges) against tiktoken's own encoding with Kimi's pattern, over the shipped corpus and a
   mixed Chinese / code / emoji set: texts, tokens, mismatching ids, failed round trips;
2. layout equivalence: SFT of an imported tiny Kimi Linear in pp2 vpp2, dp2 ep2 MoonEP ZeRO-2 and cp2 against one
   process, 3 steps (tests/chat/test_sft_layouts.py, its printed maxima);
3. learning: held-out assistant loss after a short SFT, rule answers vs the same answers shuffled;
4. prepare-data --chat throughput on the shipped corpus (KJV: each verse the user turn, the next verse the answer),
   with the shipped tokenizer.json and with the tiktoken tokenizer; plain-text prepare beside it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sft.py            # all four (several minutes on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sft.py --quick    # a smoke run: 20 chapters, figures 1 and 4

Take figures on an idle machine (the throughput and the step times are wall-clock).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "chat")]

import tiktoken  # noqa: E402

from chat_helpers import KIMI_NAMES, write_jsonl, write_kimi_tokenizer  # noqa: E402
from k3train.data.chat.prepare import prepare_chat  # noqa: E402
from k3train.data.corpus import DEFAULT_CORPUS, read_documents  # noqa: E402
from k3train.data.prepare import prepare  # noqa: E402
from k3train.data.special_tokens import SpecialTokens  # noqa: E402
from k3train.data.tiktoken_tokenizer import KIMI_PATTERN, read_tiktoken_files  # noqa: E402
from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer  # noqa: E402

MIXED = ["天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。", "def f(x):\n    return x ** 2  # 🎉🚀\n",
         "naïve café 👩‍👩‍👧‍👦 1234567 ＵＮＩＣＯＤＥ ひらがな 한국어", "\t\r\n  spaces   \n\n"]
TEMPLATE = ("{% for m in messages %}{{ '<|bos|>' + m['role'] + '\n' }}{% generation %}{% if m['role'] == 'assistant' %}"
            "{{ m['content'] + '<|eos|>' }}{% endif %}{% endgeneration %}{% if m['role'] != 'assistant' %}"
            "{{ m['content'] + '<|eos|>' }}{% endif %}{% endfor %}")


def parity(tmp: Path, docs: list[str]) -> None:
    path = write_kimi_tokenizer(tmp / "kimi")
    tok = load_tokenizer(path, SpecialTokens(*KIMI_NAMES))
    _, _, ranks, specials = read_tiktoken_files(path)
    ref = tiktoken.Encoding(name="ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    texts = docs + MIXED
    bad_ids = bad_trip = n_tok = 0
    for s in texts:
        ids = tok.encode(s)
        n_tok += len(ids)
        bad_ids += ids != ref.encode(s, allowed_special="all")
        bad_trip += tok.decode(ids) != s
    print(f"tokenizer parity: {len(texts)} texts, {sum(map(len, texts)):,} chars, {n_tok:,} tokens; texts whose ids "
          f"differ from tiktoken's: {bad_ids}; failed round trips: {bad_trip}", flush=True)


def throughput(tmp: Path, docs: list[str], show: bool = True) -> None:
    recs = []
    for d in docs:
        verses = [v for v in d.splitlines() if v.strip()]
        recs += [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
                 for a, b in zip(verses[::2], verses[1::2])]
    src = write_jsonl(tmp / "kjv_chat.jsonl", recs)
    (tmp / "t.jinja").write_text(TEMPLATE)
    kimi = load_tokenizer(tmp / "kimi" / "tiktoken.model", SpecialTokens(*KIMI_NAMES))
    for name, tok, template in (("tokenizer.json", load_tokenizer(DEFAULT_TOKENIZER), tmp / "t.jinja"),
                                ("tiktoken", kimi, None)):
        t0 = time.perf_counter()
        _, st = prepare_chat([src], tok, tmp / f"chat_{name}", template)
        dt = time.perf_counter() - t0
        if show:
            print(f"prepare-data --chat ({name}): {st.conversations:,} conversations, {st.tokens:,} tokens "
                  f"({st.assistant_tokens / st.tokens:.1%} assistant) in {dt:.2f} s = {st.tokens / dt:,.0f} tokens/s, "
                  f"{st.conversations / dt:,.0f} conversations/s", flush=True)
    (tmp / "plain.txt").write_text("\n<|endofdoc|>\n".join(docs))
    t0 = time.perf_counter()
    info = prepare([tmp / "plain.txt"], DEFAULT_TOKENIZER, tmp / "plain")
    dt = time.perf_counter() - t0
    if show:
        print(f"prepare-data (plain text, tokenizer.json, beside it): {info.num_tokens:,} tokens in {dt:.2f} s = "
              f"{info.num_tokens / dt:,.0f} tokens/s", flush=True)


def from_tests(test: str, pattern: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [ln.strip() for ln in res.stdout.splitlines() if re.search(pattern, ln)]
    for ln in lines:
        print(ln, flush=True)
    if res.returncode != 0 or not lines:
        print(f"{test}: exit {res.returncode}\n{res.stdout[-3000:]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 chapters, parity and throughput only (a smoke run)")
    a = ap.parse_args()
    n = 20 if a.quick else None
    docs = [d.text for d in itertools.islice(read_documents(DEFAULT_CORPUS), n)]
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(DEFAULT_TOKENIZER)
        parity(Path(tmp), docs)
        throughput(Path(tmp), docs[:2], show=False)  # warm-up: megatron's import, jinja's compile
        throughput(Path(tmp), docs)
    if not a.quick:
        from_tests("tests/chat/test_sft_layouts.py::test_sft_layouts_equal_one_process", r"sft layout ")
        from_tests("tests/chat/test_sft_layouts.py::test_sft_learns_what_only_the_answers_teach", r"held-out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
