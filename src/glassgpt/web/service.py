"""The web page's rules, without HTTP: what each /api/ route answers, as methods of one object.

    service = ExplainService(model, tokenizer, About("gpt2", random_weights=True))
    service.explain(ExplainRequest(prompt="Every effort moves you"))   -> the trace as JSON
    service.append(AppendRequest(ids=[...], token=2300))               -> the trace of ids + [token]
    service.diagram(ExplainRequest(...))                              -> the trace drawn as SVG
    service.why(WhyRequest(prompt=..., target=2300))                  -> why that token (explain/why.py)
    service.info(), service.snapshots()

A Qwen3 or Llama 3.2 model (families/) gets explain/trace.py's rotary trace: its stages, the four answers,
where positions enter (RoPE), the query and key/value head shapes and the group sharing, under
`family`, beside the tokens and next tokens the page shows for every model; its why is why.py's
(why.py: the parts through RMSNorm, one per query head, with the same fields as GPT-2's).
The head's dot products, the logit lens and the attention heatmaps (every query head's, with the
key/value group it reads) come from the family trace too, under the names GPT-2's answer gives them,
so the page draws them alike. Its controls are the options that apply to it (top_k and why's).

app.py wires these to routes and adds what only HTTP needs (streaming, cancelling when the
client leaves, status codes). A prompt longer than the server takes is cut as prompt.py cuts
it for every command, and the answer's `notes` say what was kept.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..adopt import adopt, check_computable
from ..errors import GlassError
from ..explain import About, Progress, trace
from ..explain.trace import family_trace
from ..explain.views import draw
from ..explain.views.diagram import to_svg
from ..explain.pieces import sliding_windows
from ..explain.options import MAX_TOP_K, TRACE_OPTIONS, WHY_OPTIONS, api_fields, controls
from ..explain.why import why
from ..explain.trace import model_facts, trace_options
from ..formats import CHECKPOINT_SUBDIRS
from ..kinds import describe
from ..model import GPTModel
from ..prompt import check_ids, encode, fit_for
from ..tokenizer import Tokenizer

MAX_BODY_BYTES = 256 * 1024  # a full 1,024-token prompt is a few KiB of JSON
# Attention weights are n_layers x n_heads x t x t numbers; past this many the page
# would receive tens of MB per step, so the trace leaves them out and says why.
MAX_ATTENTION_WEIGHTS = 1_000_000
# The embedding check builds a [t, V] one-hot matrix (and its int64 indices first): 2**24 numbers is
# 64 MB in float32, up to 333 of GPT-2's tokens; past it the check is left out and says why.
MAX_ONE_HOT_NUMBERS = 2 ** 24
# The options that apply to a Qwen3/Llama model's trace (explain/trace.py's rotary trace) and why (why.py): the page
# draws these alone.
FAMILY_OPTIONS = ("top_k", "logit_lens", "attention", "why", "versus", "patch")
# Heavy work waits in a queue of its own (app.py), so that a flood of it never delays a plain trace:
# activation patching (a forward pass per layer and prompt position), why past HEAVY_WHY_TOKENS (one
# forward pass per prompt token, each removed in turn), and any trace past HEAVY_TOKENS.
HEAVY_TOKENS = 128
HEAVY_WHY_TOKENS = 32


class TraceRequest(BaseModel):
    """What the page asks for. Give `prompt` (text) or `ids` (token ids), not both."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    ids: list[int] | None = None


# Every option's field (top_k, temperature, block, logit_lens, attention, embedding_check; why, versus,
# patch) comes from its one declaration in explain/options.py, with its default and its bounds.
ExplainRequest = create_model("ExplainRequest", __base__=TraceRequest, **{
    name: (kind, Field(default, **bounds)) for name, (kind, default, bounds) in
    api_fields(TRACE_OPTIONS + WHY_OPTIONS).items()})


class AppendRequest(ExplainRequest):
    token: int = Field(ge=0)


class WhyRequest(ExplainRequest):
    target: int | None = Field(None, ge=0)  # the candidate to explain (default: the top one)


class WindowsRequest(BaseModel):
    """A text's sliding windows, as the book's GPTDatasetV1 cuts them (no model runs)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(max_length=20_000)
    max_length: int = Field(4, ge=1, le=1024)
    stride: int | None = Field(None, ge=1, le=1024)


def public_name(spec: str) -> str:
    """How the page names a model: a file or directory by its name (with its run's name for best/ or
    latest/), never by the server's absolute path; a preset or hub id as it was typed."""
    path = Path(spec)
    if not (path.is_absolute() or path.exists() or spec.startswith((".", "~"))):
        return spec
    path = path.expanduser().resolve()
    return f"{path.parent.name}/{path.name}" if path.name in CHECKPOINT_SUBDIRS and path.parent.name else path.name


class ExplainService:
    """The API's rules for one model, which every request shares and only reads."""

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, about: About | None = None,
                 max_prompt_tokens: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 run_dir: str | Path | None = None) -> None:
        check_computable(model, tokenizer)  # before the first request: weights that cannot compute are named now
        model = adopt(model, described=True)  # a reader's module read in place; chapter 4's variants as they are
        cfg = model.cfg
        limit = cfg.context_length if max_prompt_tokens is None else max_prompt_tokens
        if not 1 <= limit <= cfg.context_length:
            raise GlassError(f"max_prompt_tokens must be in 1..{cfg.context_length:,} (the context_length), got {limit:,}")
        about = about or About()
        self.model, self.tokenizer, self.limit = model, tokenizer, limit
        self.about = dataclasses.replace(about, name=public_name(about.name))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.is_classifier = cfg.num_classes is not None
        # a model whose positions enter inside its attention (RoPE) has the rotary trace, and its options alone
        self.family = cfg.family if describe(model).positions.kind != "learned" else None
        self.max_body_bytes = max_body_bytes

    def info(self) -> dict[str, Any]:
        """GET /api/model: the loaded model, its limits, and whether a run's evaluations can be shown."""
        model = self.model
        facts = model_facts(model, self.tokenizer, self.about)
        lists = {"trace": controls(TRACE_OPTIONS), "why": controls(WHY_OPTIONS)}
        if self.family:  # only the options its trace and why take
            lists = {k: [c for c in v if c["name"] in FAMILY_OPTIONS] for k, v in lists.items()}
        return {
            **facts, "kind": "classifier" if self.is_classifier else "language model", "family": self.family,
            "params": _params(model),
            "limits": {"max_prompt_tokens": self.limit, "max_top_k": MAX_TOP_K, "max_body_bytes": self.max_body_bytes,
                       "max_attention_weights": MAX_ATTENTION_WEIGHTS},
            "run": self.run_dir is not None, "controls": lists,
        }

    def explain(self, req: ExplainRequest, cancel: threading.Event | None = None,
                progress: Progress | None = None) -> dict[str, Any]:
        """POST /api/explain: the trace of `prompt` (or `ids`) as JSON."""
        return self._trace_json(req, self._ids(req), cancel, progress)

    def append(self, req: AppendRequest, cancel: threading.Event | None = None,
               progress: Progress | None = None) -> dict[str, Any]:
        """POST /api/append: the trace of the prompt's ids + [token] (the window slides past the limit)."""
        if self.is_classifier:
            raise GlassError("this model is a classifier: its output is a class, not a token to append")
        return self._trace_json(req, self._ids(req) + [req.token], cancel, progress)

    def diagram(self, req: ExplainRequest, cancel: threading.Event | None = None,
                progress: Progress | None = None) -> str:
        """POST /api/diagram.svg: the same trace, drawn."""
        prompt = self._fit(self._ids(req))
        if self.family:
            return draw.to_svg(family_trace(self.model, self.tokenizer, ids=prompt.ids, top_k=req.top_k).picture())
        with_check = req.embedding_check and len(prompt.ids) * self.model.cfg.vocab_size <= MAX_ONE_HOT_NUMBERS
        options = trace_options(req, embedding_check=with_check, timing=False)  # the picture says when it was left out
        tr = trace(self.model, self.tokenizer, ids=prompt.ids, options=options, about=self.about, cancel=cancel,
                   progress=progress)
        tr.notes = [prompt.note, *tr.notes] if prompt.note else tr.notes
        return to_svg(tr)

    def why(self, req: WhyRequest, cancel: threading.Event | None = None,
            progress: Progress | None = None) -> dict[str, Any]:
        """POST /api/why: which parts and prompt tokens made `target` (default: the top token)."""
        prompt = self._fit(self._ids(req))
        return self._why(req, prompt.ids, cancel)

    def _why(self, req: ExplainRequest, ids: list[int], cancel) -> dict[str, Any]:
        versus = req.versus or None
        if versus is not None and versus.lstrip("-").isdigit() and self.is_classifier:
            versus = int(versus)
        result = why(self.model, self.tokenizer, ids=ids, versus=versus, patch=req.patch or None,
                     target=getattr(req, "target", None), labels=self.about.labels, top_k=req.top_k, cancel=cancel,
                     reading=self.about.reading)
        return result.to_dict()

    def is_heavy(self, req: ExplainRequest, asks_why: bool = False) -> bool:
        """Whether `req` (`asks_why`: sent to /api/why) is heavy work: see HEAVY_TOKENS. A request that is
        wrong is not heavy: it is answered at once, with its error."""
        if getattr(req, "patch", None):
            return True
        try:
            t = min(len(self._ids(req)) + isinstance(req, AppendRequest), self.limit)
        except GlassError:
            return False
        return t > (HEAVY_WHY_TOKENS if asks_why or getattr(req, "why", False) else HEAVY_TOKENS)

    def snapshots(self) -> dict[str, Any]:
        """GET /api/snapshots: each evaluation of the run the model came from, with its snapshot."""
        if self.run_dir is None:
            raise GlassError("this server was not started on a run directory: serve --model RUN_DIR to watch it learn")
        return read_snapshots(self.run_dir)

    def windows(self, req: WindowsRequest) -> dict[str, Any]:
        """POST /api/windows: the prompt's windows under this server's tokenizer (inputs, targets, overlap)."""
        return sliding_windows(req.prompt, req.max_length, req.stride, tokenizer=self.tokenizer).to_dict()

    # -- the rules every trace request follows -------------------------------------------------

    def _ids(self, req: ExplainRequest) -> list[int]:
        if req.prompt is not None and req.ids is not None:
            raise GlassError("give \"prompt\" (text) or \"ids\" (token ids), not both")
        if req.block >= self.model.cfg.n_layers:
            raise GlassError(f"block {req.block} does not exist: choose 0..{self.model.cfg.n_layers - 1}")
        if req.ids is not None:
            return check_ids(req.ids, min(self.tokenizer.n_vocab, self.model.cfg.vocab_size))
        return encode(self.tokenizer, req.prompt)

    def _fit(self, ids: list[int]):
        cfg = self.model.cfg
        why = None if self.limit == cfg.context_length else "this server's --max-prompt-tokens"
        return fit_for(ids, cfg.context_length, cfg.num_classes, self.about.reading, self.limit, why)

    def _trace_json(self, req: ExplainRequest, ids: list[int], cancel, progress) -> dict[str, Any]:
        cfg = self.model.cfg
        prompt = self._fit(ids)
        if self.family:
            return self._family_json(req, prompt, cancel)
        t = len(prompt.ids)
        with_attention, omitted = self._attention_fits(req, t)
        with_check = req.embedding_check and t * cfg.vocab_size <= MAX_ONE_HOT_NUMBERS
        options = trace_options(req, attention=with_attention, embedding_check=with_check, timing=False)
        out = trace(self.model, self.tokenizer, ids=prompt.ids, options=options, about=self.about, cancel=cancel,
                    progress=progress).to_dict()
        if prompt.note:
            out["notes"] = [prompt.note, *out["notes"]]
        if req.embedding_check and not with_check:
            most = MAX_ONE_HOT_NUMBERS // cfg.vocab_size
            out["embedding_check"] = {
                "omitted": f"{t:,} tokens make a one-hot matrix of {t * cfg.vocab_size:,} numbers ({t} x "
                           f"{cfg.vocab_size:,}); the page checks prompts of up to {most} tokens (the terminal checks "
                           "any: glassgpt explain)"}
        if req.why:
            out["why"] = self._why(req, prompt.ids, cancel)
        if with_attention:
            out["attention"]["layers"] = _rounded(out["attention"]["layers"])
        elif omitted:
            out["attention"] = {"omitted": omitted}
        return out

    def _attention_fits(self, req: ExplainRequest, t: int) -> tuple[bool, str | None]:
        """Whether the page gets the attention weights of a t-token prompt, and if asked and left out, why."""
        cfg = self.model.cfg
        n_weights = cfg.n_layers * cfg.n_heads * t ** 2
        if not req.attention or n_weights <= MAX_ATTENTION_WEIGHTS:
            return req.attention, None
        most = int((MAX_ATTENTION_WEIGHTS / (cfg.n_layers * cfg.n_heads)) ** 0.5)
        return False, (f"{t:,} tokens give {n_weights:,} attention weights ({cfg.n_layers} layers x {cfg.n_heads} "
                       f"heads x {t} x {t}); the page shows them for prompts of up to {most} tokens")

    def _family_json(self, req: ExplainRequest, prompt, cancel) -> dict[str, Any]:
        """A Qwen3/Llama model's trace (explain/trace.py's rotary trace) under `family`, with what every model's page shows
        under GPT-2's names: the tokens, the next tokens, the head's dot products, the logit lens and the
        attention weights (each query head's, with `groups`: the key/value group each head reads)."""
        with_attention, omitted = self._attention_fits(req, len(prompt.ids))
        tr = family_trace(self.model, self.tokenizer, ids=prompt.ids, top_k=req.top_k, attention=with_attention,
                          logit_lens=req.logit_lens)
        family = tr.to_dict()
        head, lens, weights = family.pop("head"), family.pop("logit_lens"), family.pop("attention_weights")
        top = tr.next_tokens
        out = {"model": model_facts(self.model, self.tokenizer, self.about), "family": family,
               "prompt": self.tokenizer.decode(prompt.ids),
               "tokens": [{"id": i, "text": self.tokenizer.decode([i])} for i in prompt.ids],
               "next_token": {"id": top[0]["id"], "text": top[0]["text"], "prob": top[0]["prob"], "top": top,
                              "kind": "token", "temperature": 1.0},
               "params": tr.params, "modules": tr.params["modules"], "notes": [prompt.note] if prompt.note else [],
               "head": head}
        if lens is not None:
            out["logit_lens"] = lens
        if weights is not None:
            out["attention"] = dict(weights, layers=_rounded(weights["layers"]))
        elif omitted:
            out["attention"] = {"omitted": omitted}
        if req.why:
            out["why"] = self._why(req, prompt.ids, cancel)
        return out


def _params(model) -> dict[str, Any]:
    """The parameter counts, each tensor once (a tied head is tok_emb's), and with the head counted twice."""
    unique = {id(p): p.numel() for p in model.parameters()}
    total = sum(unique.values())
    anatomy = describe(model)  # the tie as the description tells it: by storage
    tied = anatomy.head.tied
    embedding = model.get_submodule(anatomy.embedding.path).weight
    return {"total": total, "total_untied": total + (embedding.numel() if tied else 0), "tied": tied}


def _rounded(layers: list) -> list:
    """Attention weights to 4 decimals: a heatmap cannot show more, and the JSON is a third the size."""
    return [[[[round(w, 4) for w in row] for row in head] for head in layer] for layer in layers]


def read_snapshots(run_dir: Path) -> dict[str, Any]:
    """The evaluations of RUN_DIR/metrics.jsonl: step, tokens, losses, and the snapshot each recorded
    (the sample prompt's top 5 next tokens, the greedy sample, the logit lens's top token per block)."""
    from ..training import read_metrics
    evaluations = [{"step": r["step"], "tokens": r["tokens"], "train_loss": r.get("train_loss"),
                    "val_loss": r.get("val_loss"), "snapshot": r.get("snapshot")}
                   for r in read_metrics(run_dir) if "val_loss" in r or "snapshot" in r]
    with_snapshots = sum(e["snapshot"] is not None for e in evaluations)
    note = None
    if not evaluations:
        note = "this run has no evaluations yet"
    elif not with_snapshots:
        note = ("this run's evaluations have no snapshots (it was made before glassgpt recorded them): "
                "the losses alone are shown")
    return {"run": public_name(str(run_dir)), "evaluations": evaluations, "with_snapshots": with_snapshots,
            "note": note}
