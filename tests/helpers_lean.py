"""The tiny prover and the REPL stand-in command shared by the ``--env lean`` training tests (tests/test_lean_train.py
on the native sampler, tests/test_train_spool.py on the vLLM worker).

No Lean compiler exists on these machines: ``standin(...)`` is the command line of
``extras/vllm_rollout/lean_repl_standin.py``, which replays replies recorded from the real Lean REPL
(tests/lean_fixtures/standin_replies.json): it accepts a proof with ``norm_num`` and answers anything else with the
recorded compiler errors. ``make_prover`` writes an HF checkpoint dir (tokenizer files and Qwen3's chat template
included) that both ``align.model.load_pretrained`` and the vLLM CPU worker load.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ROOT / "extras" / "vllm_rollout"
FIX = Path(__file__).resolve().parent / "lean_fixtures"
ERR = "\nError 1:\n\nCorresponding Code:\n```lean4\n<error>x</error>\n\n```\n\nError Message: unsolved goals\n"
STATEMENT = "theorem t : 1 + 1 = 2 := by\n"  # every training row states it (so a copied answer keeps the statement)
PROOFS = (
    "```lean4\ntheorem t : 1 + 1 = 2 := by\n  norm_num\n```",  # the stand-in accepts it
    "```lean4\ntheorem t : 1 + 1 = 2 := by\n  simp\n```",  # the stand-in answers the recorded errors
)
SFT_STEPS = 60


def standin(log: str | Path | None = None) -> str:
    """The ``--lean-repl`` command of the stand-in; with ``log`` each process appends every command it gets there."""
    cmd = f"{sys.executable} {EXTRAS / 'lean_repl_standin.py'} --replies {FIX / 'standin_replies.json'}"
    return cmd if log is None else f"{cmd} --log {log}"


STANDIN = standin()


def load_script(path: Path):
    """A script of ``extras/vllm_rollout`` (not a package) imported from its file, as ``sys.modules[its stem]`` so
    the scripts it imports by bare name resolve to it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def lean_rows(n: int) -> list[dict]:
    return [{"name": f"p{i}", "formal_statement": STATEMENT} for i in range(n)]


def make_prover(d: Path) -> str:
    """A tiny Qwen2 (random weights, then SFT_STEPS supervised steps) that answers Goedel's prompt for STATEMENT with
    one of PROOFS and its stop token, and answers the correction feedback to the failing one (the stand-in's recorded
    errors) with the failing one again: sampled episodes get both verdicts, correction feedback and second turns, and
    a failed first turn fails again (so --max-turns 2 episodes end in feedback and feed the correction queue). The
    tokenizer is a byte-level BPE with Qwen3's chat template (tests/helpers_tokenizer.py); head_dim 32, as the vLLM
    CPU build's attention needs. Returns the model dir (``d / "model"``)."""
    import torch
    from helpers_tokenizer import make_bpe_tokenizer

    from align.chat import TurnRenderer
    from align.data import load_tokenizer
    from align.lean import goedel
    from align.lean.config import LeanConfig
    from align.lean.verify import LeanVerifier
    from align.model import ModelConfig, Transformer, save_pretrained

    verifier = LeanVerifier(LeanConfig(repl=STANDIN, workers=1))
    try:
        feedback = goedel.correction_feedback(verifier.verify([(STATEMENT, PROOFS[1])])[0].errors, 1)
    finally:
        verifier.close()
    corpus = [goedel.initial_prompt(STATEMENT), goedel.correction_feedback(ERR, 1), *PROOFS] * 20  # short prompts
    make_bpe_tokenizer(d / "base", vocab_size=500, template="qwen3", corpus=corpus)
    tok = load_tokenizer(str(d / "base"), str(d / "base"))
    eos = tok.eos_token_id if isinstance(tok.eos_token_id, int) else tok.eos_token_id[0]
    cfg = ModelConfig("qwen2", 512, 64, 128, 2, 2, 1, 32, max_position_embeddings=1024, qkv_bias=True,
                      eos_token_id=eos)  # fmt: skip
    model = Transformer(cfg).init_weights(std=0.2, seed=0)
    renderer = TurnRenderer(tok)
    prompt = renderer.first(goedel.initial_messages(STATEMENT))
    second = prompt + tok.encode(PROOFS[1]) + [eos] + renderer.suffix([{"role": "user", "content": feedback}])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seqs = [(prompt, PROOFS[0]), (prompt, PROOFS[1]), (second, PROOFS[1])]  # (context, the answer trained on)
    for step in range(SFT_STEPS):
        context, answer = seqs[step % len(seqs)]
        target = tok.encode(answer) + [eos]
        ids = torch.tensor([context + target])  # (1, T)
        logits = model(ids[:, :-1])  # (1, T-1, V)
        loss = torch.nn.functional.cross_entropy(logits[0, -len(target) :], ids[0, -len(target) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model.eval(), d / "model", copy_tokenizer_from=d / "base")
    return str(d / "model")
