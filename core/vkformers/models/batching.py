"""``BatchScheduler``: continuous batching of generation requests for a server (``vkformers serve``).

One thread owns the model. Each turn of its loop is a step boundary: new requests join the running batch there,
finished or cancelled ones leave, then one decode step runs for every row at once. The batch lives in one
:class:`KVCache` as a left-padded batch, as ``generate`` runs one: every row writes its next token at the same
column and the cache's padding mask hides the columns before each row's first token. Requests join in one of
two ways. Into free rows (left by finished requests, or fillers): their prompts are prefilled apart, in a small
cache (PREFILL_CHUNK columns a turn, at most PREFILL_TOKENS tokens, the running batch decoding a step between two
chunks), and their keys and values moved into those rows so as to end at the batch's current column
(``KVCache.place_row``); the running rows lose no work (a prompt longer than the batch's columns so far first
moves the batch right, a copy of its cache). When no free rows fit them (too few, or past the column limit), the
batch is rebuilt: the prompts and the tokens generated so far of every live request are prefilled together (in
chunks of at most PREFILL_TOKENS tokens) into a cache of a recorded size (rows rounded up to a power of two, so
that the decode step replays one of a few captured plans, models/decode_capture.py). Prefills replay too: a chunk
of the shape (rows, columns, stored columns, cache) of two chunks before it replays their confirmed plan, as
generate's prefills do (_prefill_capture; prompts laid out at a multiple of PREFILL_BUCKET columns on a GPU,
so that nearby lengths share shapes). A request that left stays as a masked row until a newcomer takes it. Each
request chooses its tokens on the host from its row's logits as ``generate`` does for a batch of one (greedy, or
temperature, top-k, top-p and min-p with its own seeded generator), so its tokens are those ``model.generate`` gives it
alone with those settings; a replayed step whose live rows are all greedy (no penalty, bias, grammar or
logprobs) has the GPU choose them and reads back the tokens instead of the logits (DecodeCapture.choose). The
thread's forwards run under no_grad.

Paged (``kv_blocks``): the caches take their keys and values from one BlockPool of that many blocks
(models/paged_cache.py), so memory follows the tokens held: a row takes blocks as its tokens come, a padding-only
block takes none, and a request that leaves gives its row's blocks back at once. Joining requests wait while the
blocks their prompts need are in use; when a decode step finds none left, the newest request is preempted (its row
given back, the request queued first again, its prompt and tokens so far prefilled anew when it rejoins). A
request that could never fit the pool is refused at submit (KVBlocksExhausted). Columns move by whole blocks of
the block tables instead of copies (models whose attention and positions count tokens, not columns): a prompt longer
than the batch's columns moves every row right (PagedKVCache.shift_right), and a batch at its column limit gives
back the leading blocks every row has to spare (PagedKVCache.compact) instead of being rebuilt.

Prefix caching (paged, on unless ``prefix_caching=False``): the full blocks of every prefilled prompt are registered
in the pool under a hash of their tokens so far (BlockPool.register); a prompt whose leading blocks are registered
takes them into its row and prefills only the rest. A batch's rows are then laid out as the prompt's full blocks
from column 0 (where shared blocks must sit, aligned), a masked gap, and the rest of its tokens ending at the
batch's column; positions count only the tokens, so the gap changes nothing for the model. A batch prefills from
the column its rows all have cached. Models whose attention or positions depend on columns (sliding windows, ALiBi,
positions by index) would see the gap: they run without prefix caching.

Recurrent state (state-space and linear-attention layers, ROW_STATES of models/cache.py): each row of the cache
holds its own conv and scan state beside its keys and values; a left-padded row's padding leaves it at zeros (the
layers zero padded positions), and placing a prompt prefilled apart moves its rows' state with its keys and values.
The scheduler's caches keep those states in persistent buffers overwritten in place (KVCache.keep_states_in_place),
so that every decode step reads and writes the same buffers and is replayed like an attention model's.
A model with no attention at all (``attention_free``) runs on a cache of no key/value layers holding only that
state. Layer state laid out by column (an indexer's keys) cannot move between rows: such models are refused.

Adapters (``adapters``, models/lora.py's serve_adapters): LoRA adapters unmerged beside the base weights, each
request taking one by number (``Request.adapter``, 0: the base model). Before each forward the scheduler writes
every row's choice into a persistent tensor of that batch size (AdapterSelector.row_scales), which the recorded
plans read as they replay; a prompt's prefix blocks are registered under a salt naming its adapter, since another
adapter's keys and values differ.

Warm-up (``warm_up``, before ``start``): synthetic requests run through the scheduler's own turns, as earlier
traffic would, so that the first real requests replay their decode steps and prefills instead of building and
recording them in Python: a batch of each given row count decoding a few steps (its decode step recorded and
confirmed), and a prompt of each given width prefilled twice alone (a rebuild of one row) and twice joining a running
batch (prefilled apart, then placed). The shapes are the live ones by construction (the same caches, layouts and
capture keys); what is not replayed afterwards (the warm-up batches' own prefills) is dropped with its plan, no
prefix block is registered, every KV block is given back and the metrics are put back as they were. The prefill
shapes it recorded are held beside the PREFILL_PLANS that live traffic's shapes take in turn, so that a burst of other
shapes does not push them out before their requests come.

Prompt log-probabilities (``SamplingParams.prompt_logprobs``: an echoed prompt's logprobs, vLLM's prompt_logprobs):
a prefill computes the last position's logits only, and a prefix cache hit computes none of the positions it covers,
so the requests that ask for them are scored apart first; the others run as before. Waiting requests that ask are
laid out as one batch (as a rebuild lays out its rows, with no prefix taken from the cache) and run through the
model in chunks of every position's logits (at most PROMPT_LOGITS of them a chunk, read back and turned into
float64 log-probabilities on the host, HOST_LOGPROBS values at a time), a chunk a turn between decode steps of the
running batch. Each prompt token's entry comes from the position before it; after the last chunk each request
takes its first token from its last position's logits (as its prefill would give it), its prompt's full blocks are
registered for prefix caching, and it waits to join the batch with its prompt and that token (a request of
max_tokens 1, or 0, is done there).

Text: a request's tokens are decoded as they come; stop strings are matched on the text (a stop string may
span tokens), and text that could still turn into a stop string or that ends in an incomplete character is held
back until the next token says.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import numpy as np

from vkformers.engine import lazy
from vkformers.engine.function import no_grad
from vkformers.engine.kernels.attention import paged_decode_fits
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError, VkformersError
from vkformers.models.cache import KVCache
from vkformers.models.decode_capture import DecodeCapture, capture_key, to_scores
from vkformers.models.generation import CACHE_ROUNDING, PREFILL_BUCKET, _sample, _softmax
from vkformers.models.generation_settings import sampling_rng
from vkformers.models.inputs import check_model_inputs
from vkformers.models.paged_cache import (LOOKAHEAD, PAGE_SIZE, BlockPool, KVBlocksExhausted, PagedKVCache,
                                          block_bytes, prefix_keys)
from vkformers.models.structured_output import GrammarError, GrammarVocabulary, TokenConstraint, any_object_grammar
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import buffer_memory, get_device

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
# Columns a batch's cache gets beyond its tokens so far (or fewer: what its requests may still generate); when
# they run out, the cache doubles (its rows copied over), so that memory follows the tokens held rather than every
# request's max_tokens. Columns are shared by all rows (each row's tokens end at the current one): past
# COLUMN_LIMIT x max_model_len of them the batch is rebuilt instead, which packs it to its longest sequence.
CACHE_GROWTH = 256
# Tokens of joining prompts prefilled per turn, a decode step of the running batch between two such chunks, so that
# a long prompt does not stall the other streams for its whole prefill.
PREFILL_CHUNK = 512
# At most this many tokens (rows x columns, padding included) in one prefill: a rebuild of many rows, or many
# joining prompts, runs in chunks of fewer columns, so that a chunk's activations stay bounded and within what one
# buffer may hold.
PREFILL_TOKENS = 8192
# Recorded prefill plans the scheduler holds (its prefills of one shape, chunk and cache replay one plan, as
# generate's do), least recently used dropped first, and as many of warm_up's shapes beside them; and at most
# lazy.MAX_PLAN_BYTES of their own buffers together.
PREFILL_PLANS = 8
# Prompt widths rounded to powers of two and whole chunks (BatchScheduler._width): fewer prefill shapes, more of them
# replayed (bench/serve.py on the H200, Llama-3-8B shape, 32 clients: 38 of 56 prefills replayed against 18, 1.36x
# the output tokens/s).
PREFILL_POWERS_OF_TWO = True
COLUMN_LIMIT = 2
COLUMN_ROUNDING = CACHE_ROUNDING
# A pool sized from device memory leaves this share of the heap (and at least ACTIVATION_RESERVE_MIN bytes) beside
# the weights for the activations of a PREFILL_TOKENS-token prefill and the recorded plans: an estimate,
# --kv-cache-tokens sets the pool exactly.
ACTIVATION_RESERVE = 0.05
ACTIVATION_RESERVE_MIN = 256 << 20
# Tokens of each warm-up request that decodes: the prefill's, two decode steps built in Python (the second confirms
# the recorded plan) and one replayed (the GPU's choice of greedy tokens recorded with it).
WARMUP_DECODE_TOKENS = 4
# Prompts up to this many chunks long are warmed up by default (1024 columns: half of the prompts of 64-1,024 tokens
# bench/serve.py sends are laid out there).
WARMUP_CHUNKS = 2
# At most this many prefill plans (one per chunk of each width, alone and joining) a warm-up records and holds beside
# PREFILL_PLANS: each holds its activations' buffers (a 512-token chunk of Llama-3-8B: some 40 MiB).
WARMUP_PREFILL_PLANS = 16
# Contiguous caches (models whose rows the paged decode cannot read) are allocated whole, one per batch size, by the
# warm-up: by default it warms the batch sizes, smallest first, whose caches together take at most this share of
# the device's memory heap (a server of such a model on a small card would otherwise run out at start).
WARMUP_CONTIGUOUS_SHARE = 0.05
WARMUP_TURNS = 1000  # a warm-up batch needs a few turns; more means it made no progress
# Prompts scored for their log-probabilities run in chunks of at most this many logits (rows x columns x vocabulary),
# read back whole: a 128k-vocabulary model's prompt in chunks of 512 positions (256 MiB of float32), and as the
# PREFILL_TOKENS of a prefill's activations allow.
PROMPT_LOGITS = 1 << 26
# The host turns at most this many logits at a time into float64 log-probabilities (32 MiB, and as much again for
# their exponentials).
HOST_LOGPROBS = 1 << 22


class SchedulerStopped(VkformersError, RuntimeError):
    """A request submitted after the scheduler's thread ended (``error`` says why)."""


class WarmupError(VkformersError, ValueError):
    """Warm-up shapes the scheduler never runs, or a warm-up that failed."""


def _whole_numbers(values, what: str) -> tuple[int, ...]:
    """warm_up's ``values`` (an iterable of whole numbers) sorted, once each; WarmupError for anything else."""
    if not isinstance(values, (list, tuple, set, frozenset)):
        raise WarmupError(f"warm-up {what} must be whole numbers, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise WarmupError(f"warm-up {what} must be whole numbers, got {value!r}")
    return tuple(sorted({int(v) for v in values}))


@dataclass
class SamplingParams:
    """One request's generation settings. ``max_tokens`` 0: no output (the prompt's log-probabilities alone).
    ``temperature`` 0: greedy. ``logprobs``: None, or how many of the most likely alternatives to report with each
    token's log-probability (0: only the chosen token's); ``prompt_logprobs``: so too for each prompt token after the
    first (Update.prompt_logprobs), under the model's distribution at the position before it.
    OpenAI's penalties, over the tokens generated so far: ``presence_penalty`` is subtracted once from the logit of
    each of them, ``frequency_penalty`` once per time it was generated; ``logit_bias``: (token, bias) pairs added to
    those tokens' logits. vLLM's: ``repetition_penalty`` divides the positive logits (multiplies the negative ones)
    of every token of the prompt and the output so far (transformers' and vLLM's rule); ``min_tokens``: no end token
    (nor stop string) before that many tokens; ``allowed_token_ids``: the only tokens that may be chosen;
    ``include_stop_str_in_output``: a stop string that ends the output stays in its text. The logit bias, the allowed
    tokens, the end tokens' mask, then the penalties (repetition first) apply before temperature, top-p and the
    greedy choice, in vLLM's order; log-probabilities are the model's, before them. ``grammar``: an llguidance
    grammar the output keeps to (models/structured_output.py: json_schema_grammar for OpenAI's response_format
    json_schema); ``json_mode``: the output one JSON object (OpenAI's json_object), the grammar any_object_grammar.
    Tokens the grammar refuses are masked before the choice (greedy, or temperature, top-k and top-p over the allowed
    ones)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token (OpenAI's API has no top-k; vLLM's takes one)
    min_p: float = 0.0  # 0: every token (vLLM's and llama.cpp's field)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()  # () : every token
    include_stop_str_in_output: bool = False
    json_mode: bool = False  # the output one JSON object (OpenAI's response_format json_object)
    grammar: str | None = None  # an llguidance grammar the output keeps to (response_format json_schema)
    prompt_logprobs: int | None = None

    def check(self) -> None:
        if self.max_tokens < 0:
            raise InputError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise InputError(f"{name} must be in 0..20, got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise InputError("logit_bias values must be in [-100, 100]")
        if not self.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be in [0, max_tokens {self.max_tokens}], got {self.min_tokens}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the host must choose this request's tokens from its own scores (penalties, bias, a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.json_mode
                    or self.grammar is not None or self.repetition_penalty != 1 or self.min_tokens
                    or self.allowed_token_ids)

    @property
    def output_grammar(self) -> str | None:
        """The grammar the output keeps to: ``grammar``, else JSON mode's, else None."""
        return self.grammar if self.grammar is not None else any_object_grammar() if self.json_mode else None


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token, which no position predicts
    top: list[tuple[int, float]]  # the most likely tokens at this step, most likely first
    rank: int | None = None  # a prompt token's rank, 1 the most likely (the tokens at least as likely counted)


@dataclass
class Update:
    """What a request produced since its last update: text (stop strings and held-back text excluded), the tokens'
    log-probabilities (with SamplingParams.logprobs), and the finish reason once it is done. ``prompt_logprobs``
    (SamplingParams.prompt_logprobs): one entry per prompt token, in an update of its own before any token."""
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    completion_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None


class Request:
    """One generation request. ``on_update`` (called on the scheduler's thread) receives each :class:`Update`."""

    def __init__(self, prompt: list[int], params: SamplingParams, on_update, eos: list[int], adapter: int = 0):
        self.prompt, self.params, self.on_update = [int(t) for t in prompt], params, on_update
        self.adapter = int(adapter)  # the scheduler's adapters: 0 the base model, k the k-th adapter
        self.eos = set(eos)
        self.rng = sampling_rng(params.seed)
        self.generated: list[int] = []
        self.counts: dict[int, int] = {}  # times each token was generated (for the penalties)
        self.text = ""       # the decoded text so far, cut at a stop string
        self.rendered = _IncrementalText()
        self.sent = 0        # characters of text already sent
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.constraint: TokenConstraint | None = None  # params.output_grammar: the output's grammar state
        self.scored = False  # its prompt's log-probabilities were sent (params.prompt_logprobs)

    @functools.cached_property
    def prompt_tokens(self) -> np.ndarray:
        """The prompt's distinct token ids (the repetition penalty's), found the first time a step asks."""
        return np.unique(np.asarray(self.prompt, np.int64))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_scoring(self) -> bool:
        """Whether its prompt's log-probabilities are still to compute (BatchScheduler._score_chunk)."""
        return self.params.prompt_logprobs is not None and not self.scored

    def cancel(self) -> None:
        """Leave at the next step boundary (a client that went away)."""
        self.cancelled = True


@dataclass
class Metrics:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0            # requests that left before their end (a client gone)
    errors: int = 0               # batches that failed (their requests got an error)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    replayed_steps: int = 0       # decode steps replayed from their recorded plan (no Python forward)
    rebuilds: int = 0             # prefills of the whole batch (requests joining when no free rows fit them)
    placements: int = 0           # prompts prefilled apart and moved into free rows of the running batch
    growths: int = 0              # doublings of the running batch's cache
    shifts: int = 0               # moves of the running batch to the right, for a longer prompt joining it
    compactions: int = 0          # paged: columns the running batch's rows all had to spare given back (no copy)
    prefill_chunks: int = 0       # chunks of joining prompts prefilled (a decode step between two)
    prefills: int = 0             # prefill forwards (a rebuild's chunks and joining prompts' chunks)
    prefill_replays: int = 0      # of those, replayed from their recorded plan (no Python forward)
    batch_rows: int = 0           # rows of the running batch (live ones and masked ones)
    live_rows: int = 0
    waiting: int = 0
    cache_tokens: int = 0         # KV entries the running batch's cache holds (rows x length)
    ttft_sum: float = 0.0
    ttft_count: int = 0
    occupancy_sum: float = 0.0    # live / batch rows, summed over decode steps
    peak_live_rows: int = 0       # most requests one decode step served
    kv_blocks: int = 0            # paged: the pool's blocks (scratch block excluded)
    kv_blocks_used: int = 0       # paged: blocks held by requests
    preemptions: int = 0          # paged: requests sent back to wait for blocks (recomputed when they rejoin)
    prefill_tokens: int = 0       # tokens of prompts (and tokens so far) computed by prefills
    prompt_logprob_tokens: int = 0  # prompt tokens whose log-probabilities were computed (their prefills counted too)
    prefix_queried_tokens: int = 0  # tokens of prompts looked up in the prefix cache
    prefix_hit_tokens: int = 0    # of those, tokens whose keys and values came from the prefix cache
    kv_blocks_cached: int = 0     # paged: blocks registered for prefix caching (held or reusable)
    kv_blocks_evicted: int = 0    # paged: registered blocks no request held, taken back for new tokens
    # the scheduler thread's wall time (GPU waits included) in its phases
    decode_seconds: float = 0.0   # decode steps' forwards, their logits read back
    prefill_seconds: float = 0.0  # prefill forwards (rebuild chunks and joining chunks)
    choose_seconds: float = 0.0   # choosing tokens from the logits, detokenizing, streaming the updates


@dataclass
class WarmupReport:
    """What ``BatchScheduler.warm_up`` recorded: decode steps of batches of ``batch_sizes`` rows; prefills of one
    prompt at each of ``prompt_widths`` columns (alone, and with ``joining`` joining a running batch),
    ``prefill_plans`` of the ``prefill_shapes`` (capture keys) it ran still held; in ``seconds``, leaving
    ``device_bytes`` more device memory held (the plans, and contiguous caches); ``skipped``: what it left out, and
    why."""
    batch_sizes: tuple[int, ...] = ()
    prompt_widths: tuple[int, ...] = ()
    joining: bool = False
    prefill_plans: int = 0
    prefill_shapes: int = 0
    seconds: float = 0.0
    device_bytes: int = 0
    skipped: tuple[str, ...] = ()

    @property
    def ran(self) -> bool:
        """Whether the warm-up had any shape to record."""
        return bool(self.batch_sizes or self.prompt_widths or self.skipped)

    def summary(self) -> str:
        done = []
        if self.batch_sizes:
            done.append(f"decode steps of {', '.join(map(str, self.batch_sizes))} rows")
        if self.prefill_shapes:
            done.append(f"prefills of prompts of {', '.join(map(str, self.prompt_widths))} columns, alone"
                        f"{' and joining a batch' if self.joining else ''} ({self.prefill_plans} of "
                        f"{self.prefill_shapes} plans held)")
        line = (f"warm-up: {'; '.join(done) or 'nothing recorded'} in {self.seconds:.2f} s, "
                f"{self.device_bytes / 2**20:.1f} MiB of device memory")
        return "; ".join([line, *self.skipped])


@dataclass
class _Layout:
    """Token histories laid out as one batch: ``ids`` and ``mask`` [rows, width]; the first ``start`` columns of
    every request's row come from the prefix cache; ``keys``: each request's prompt block keys, of which the first
    ``aligned`` blocks sit aligned from column 0 (registered once prefilled)."""
    ids: np.ndarray
    mask: np.ndarray
    start: int = 0
    keys: tuple = ()
    aligned: tuple = ()


@dataclass
class _Prefill:
    """Joining prompts being prefilled into ``cache``, ``done`` of their (laid out) tokens so far."""
    requests: list[Request]
    layout: _Layout
    positions: np.ndarray
    cache: KVCache
    done: int = 0


@dataclass
class _Scoring(_Prefill):
    """Prompts whose log-probabilities are being computed (BatchScheduler._score_chunk): ``entries``, per request,
    those of its prompt tokens so far."""
    entries: list[list[TokenLogprob]] = field(default_factory=list)


class RequestScheduler:
    """What every scheduler of ``vkformers serve`` shares: requests queued from the server's threads and run by one
    thread of its own, each request's tokens chosen on the host from its row of a step's logits as ``generate``
    does for a batch of one, and its text streamed (stop strings, log-probabilities, the finish reason) through
    ``Update`` calls. A subclass sets up what ``_setup`` names and runs the requests (``_serve``)."""

    def _setup(self, model, tokenizer, *, max_batch: int, max_model_len: int, eos, vocab_size: int,
               adapters=None) -> None:
        self.model, self.tokenizer, self.adapters = model, tokenizer, adapters
        self.max_batch, self.max_model_len, self.vocab_size = int(max_batch), int(max_model_len), int(vocab_size)
        self.eos = sorted({int(e) for e in eos})
        self.metrics = Metrics()
        self._waiting: list[Request] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.error: BaseException | None = None       # what ended the thread (then no request is taken)
        self.last_error: Exception | None = None      # the last failure of a batch (the thread goes on)

    def start(self) -> "RequestScheduler":
        self._thread = threading.Thread(target=self._loop, name="vkformers-scheduler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise InputError when a prompt of ``prompt_tokens`` and ``max_tokens`` more do not fit max_model_len."""
        if prompt_tokens < 1:
            raise InputError("the prompt is empty")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise InputError(f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) exceed the "
                             f"maximum context length of {self.max_model_len} tokens; shorten the prompt or lower "
                             "max_tokens")

    def submit(self, request: Request) -> Request:
        """Queue ``request``; InputError (before it runs) for one the model cannot take."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[Request]:
        """Queue ``requests`` together (a call's choices and prompts), each checked first: one the model cannot take
        is an InputError and none of them runs."""
        for request in requests:
            self._check_request(request)
        with self._cond:
            if self.error is not None:
                raise SchedulerStopped(f"the scheduler stopped: {self.error}")
            self._waiting.extend(requests)
            self.metrics.requests += len(requests)
            self.metrics.prompt_tokens += sum(len(request.prompt) for request in requests)
            self.metrics.waiting = len(self._waiting)
            self._cond.notify_all()
        return requests

    def _check_request(self, request: Request) -> None:
        """What submit checks of a request (InputError), its grammar compiled."""
        if not 0 <= request.adapter <= len(self.adapters.names if self.adapters is not None else ()):
            raise InputError(f"adapter {request.adapter} is not one of this scheduler's")
        request.params.check()
        vocab = self.vocab_size
        for name, tokens in (("logit_bias", [t for t, _ in request.params.logit_bias]),
                             ("allowed_token_ids", request.params.allowed_token_ids)):
            wrong = [t for t in tokens if not 0 <= t < vocab]
            if wrong:
                raise InputError(f"{name} names token {wrong[0]}, outside the model's vocabulary of {vocab}")
        self.check(len(request.prompt), request.params.max_tokens)
        grammar = request.params.output_grammar
        if grammar is not None:  # compiled here, where a bad grammar is the caller's error, not the batch's
            request.constraint = TokenConstraint(GrammarVocabulary.of(self.tokenizer, vocab), grammar, request.eos)
        limits = self.model.input_limits() if hasattr(self.model, "input_limits") else None
        if limits is not None:  # here, not on the scheduler's thread, where a bad prompt would fail its batch
            check_model_inputs(limits, {"input_ids": np.asarray([request.prompt], np.int64)})

    def _finished_one(self) -> None:
        """A request finished (a subclass's bookkeeping)."""

    def _loop(self) -> None:
        with no_grad():  # the forwards of this thread record no gradient (the mode is per thread)
            self._serve()

    def _serve(self) -> None:
        raise NotImplementedError

    def _fail(self, requests) -> None:
        for request in requests:
            if request is not None and not request.finished:
                request.finish_reason = FINISH_ERROR
                request.on_update(Update("", [], FINISH_ERROR, len(request.generated)))

    def _choose(self, logits: np.ndarray | None, rows: list[tuple[int, Request]], chosen=None) -> None:
        """Each live request's next token from its row of ``logits``, as generate chooses for a batch of one
        (``chosen``: the tokens the GPU chose instead, every live row greedy)."""
        now = time.perf_counter()
        try:
            self._choose_rows(logits, rows, chosen, now)
        finally:
            self.metrics.choose_seconds += time.perf_counter() - now

    def _choose_rows(self, logits, rows: list[tuple[int, Request]], chosen, now: float) -> None:
        for row, request in rows:
            if request.finished:
                continue
            params = request.params
            scores = None if chosen is not None else logits[row:row + 1]
            chosen_from = _adjusted(scores, request) if params.adjusts_logits else scores
            if request.constraint is not None:  # (never GPU-chosen: adjusts_logits)
                try:
                    chosen_from = request.constraint.mask(chosen_from)
                except GrammarError as exc:  # the engine failed on this output: it alone ends
                    self.last_error = exc
                    self._fail([request])
                    continue
            if chosen is not None:
                token = int(chosen[row])
            elif params.temperature == 0:
                token = int(chosen_from.argmax(axis=-1)[0])
            else:
                token = int(_sample(chosen_from, request.rng, params.temperature, params.top_k, params.top_p,
                                    params.min_p)[0])
            if request.constraint is not None:
                request.constraint.advance(token)
            request.generated.append(token)
            request.counts[token] = request.counts.get(token, 0) + 1
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.ttft_sum += now - request.arrived
                self.metrics.ttft_count += 1
            self.metrics.generation_tokens += 1
            if params.logprobs is not None:
                request.pending_logprobs.append(_logprob(scores[0], token, params.logprobs))
            self._advance_text(request, token)
            if request.constraint is not None and request.constraint.complete and not request.constraint.ends \
                    and not request.finished:  # no end token to close with: the grammar's text is the whole output
                self._finish(request, FINISH_STOP)

    def _advance_text(self, request: Request, token: int) -> None:
        params = request.params
        finish = None
        stopped = token in request.eos  # an end token (or a stop token id) is not part of the text
        tokens = request.generated[:-1] if stopped else request.generated
        if stopped or len(request.generated) >= params.max_tokens:  # the last text: decoded whole
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.startswith(request.text[:request.sent]):  # (what was sent stays sent)
                text = request.rendered.extend(self.tokenizer, tokens)
        else:
            text = request.rendered.extend(self.tokenizer, tokens)
        if params.stop and len(request.generated) >= params.min_tokens:
            # a stop string in the text not yet sent (the sent text held back enough to contain none)
            found = [(i, len(s)) for i, s in ((text.find(s, request.sent), s) for s in params.stop if s) if i >= 0]
            if found:
                at, length = min(found)
                text, finish = text[:at + length if params.include_stop_str_in_output else at], FINISH_STOP
        request.text = text
        if finish is None and stopped:
            finish = FINISH_STOP
        if finish is None and len(request.generated) >= params.max_tokens:
            finish = FINISH_LENGTH
        if finish is not None:
            self._finish(request, finish)
            return
        hold = max((len(s) for s in params.stop), default=1) - 1  # the end of the text may begin a stop string
        ready = len(text) - hold
        while ready > request.sent and text[ready - 1] == "\ufffd":  # an incomplete character waits
            ready -= 1
        if ready > request.sent or request.pending_logprobs:
            delta = text[request.sent:max(ready, request.sent)]
            request.sent += len(delta)
            logprobs, request.pending_logprobs = request.pending_logprobs, []
            request.on_update(Update(delta, logprobs, None, len(request.generated)))

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.metrics.finished += 1
        self._finished_one()
        self.metrics.cancelled += reason == FINISH_CANCELLED
        delta = request.text[request.sent:]
        request.sent = len(request.text)
        logprobs, request.pending_logprobs = request.pending_logprobs, []
        request.on_update(Update(delta, logprobs, reason, len(request.generated)))


class BatchScheduler(RequestScheduler):
    """Runs requests on ``model`` (a GenerationMixin causal LM), ``tokenizer`` decoding their text.

    ``adapters``: an AdapterSelector (models/lora.py's serve_adapters) whose adapters requests pick by number.
    ``max_batch``: most requests decoded together (more wait); ``max_model_len``: most tokens (prompt and
    generated) of one request; ``kv_blocks``: a paged KV cache of that many blocks of ``page_size`` tokens (None:
    contiguous caches, unless ``gpu_memory_utilization``). ``gpu_memory_utilization`` (with ``kv_blocks`` None): a
    paged cache of as many blocks as fit in that share of the device's memory heap, less the buffers this process
    holds (the weights) and a reserve for activations; where a paged cache cannot run the model, contiguous caches,
    and ``kv_cache_note`` says why. ``start()`` starts the thread; ``submit()`` queues a request; ``close()`` stops.
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 64, max_model_len: int | None = None, eos=(),
                 kv_blocks: int | None = None, page_size: int = PAGE_SIZE, prefix_caching: bool = True,
                 cache_salt: str = "", gpu_memory_utilization: float | None = None, adapters=None):
        limit = int(getattr(model, "max_position_embeddings", 0) or 0) or None
        max_model_len = int(max_model_len or limit or 2048)
        if limit is not None and max_model_len > limit:
            raise InputError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
        self._setup(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len, eos=eos, vocab_size=0,
                    adapters=adapters)  # the vocabulary: the probe's logits (_refuse_row_state)
        self._adapter_scales: dict[int, tuple[Tensor, np.ndarray]] = {}  # rows -> persistent scales, their values
        self.pad = self.eos[0] if self.eos else 0
        self.kv_blocks, self.page_size = (None if kv_blocks is None else int(kv_blocks)), int(page_size)
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise InputError(f"kv_blocks must be >= 2, got {kv_blocks}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self._pool: BlockPool | None = None
        self._rows: list[Request | None] = []  # the running batch, one entry per cache row (None: a filler row)
        self._releases: list[threading.Event] = []  # release_caches() calls waiting for the thread to go idle
        self._caches: dict[int, tuple[KVCache, DecodeCapture | None, object]] = {}  # rows -> cache, capture, key
        self._joining_caches: dict[int, KVCache] = {}  # rows -> the cache joining prompts are prefilled into
        self._prefill_captures: OrderedDict = OrderedDict()  # prefill shape -> (DecodeCapture, capture_key)
        self._warmed_prefills: set = set()  # the shapes warm_up recorded: kept beside PREFILL_PLANS of live traffic
        self._warmup_prefills_run: set = set()  # the prefill shapes the last warm-up ran
        self._joining: list[Request] = []
        self._prefilling: _Prefill | None = None  # joining prompts being prefilled, a chunk per turn
        self._to_score: list[Request] = []  # waiting requests taken for scoring at this turn (_start_scoring)
        self._scoring: _Scoring | None = None  # prompts being scored for their log-probabilities, a chunk per turn
        self._scoring_caches: dict[int, KVCache] = {}  # rows -> the cache prompts are scored in
        # paged: after the pool ran out where no request could be preempted (a prefill), at most this many requests
        # are admitted at once, halved at each such failure, until a request finishes and gives blocks back: the
        # same requests do not fail together again and again (one alone always fits: check)
        self._admit_limit: int | None = None
        self._state = None  # host arrays of the running batch: (cache, capture, tokens, mask, prompt length)
        self._warming = False  # warm_up's requests run: their prompts' blocks are not offered to later prompts
        self._refuse_row_state()
        self.vocab_size = self._probe_logits.shape[-1]
        self.kv_cache_note: str | None = None  # why contiguous caches run where a paged one was asked for
        paging = self.kv_blocks is not None or gpu_memory_utilization is not None
        refusal = self._paged_refusal() if paging else None
        if refusal is not None and self.kv_blocks is not None:  # asked for explicitly: say it cannot
            raise InputError(f"a paged KV cache cannot run {self._name()}: {refusal}; drop --kv-cache-tokens "
                             "(kv_blocks) for contiguous caches")
        if refusal is None and getattr(model, "attention_free", False):
            refusal = "the model has no attention layers, no keys or values to page"
        if refusal is not None and gpu_memory_utilization is not None and self.kv_blocks is None:
            self.kv_cache_note = f"contiguous KV caches: {refusal}"
        elif self.kv_blocks is None and gpu_memory_utilization is not None:
            self.kv_blocks = self._blocks_for_memory(float(gpu_memory_utilization))
        self.metrics.kv_blocks = max((self.kv_blocks or 1) - 1, 0)
        # the salt: what else than the tokens makes the keys and values (the weights, an adapter merged into them)
        self._salt = f"{type(model).__name__}|{cache_salt}".encode()
        self._adapter_salts = [self._salt] + [self._salt + f"|adapter|{name}".encode()
                                              for name in (adapters.names if adapters is not None else ())]
        self.prefix_caching = (bool(prefix_caching) and self.kv_blocks is not None and not self._column_bound
                               and not self._recurrent)

    def _name(self) -> str:
        return getattr(self.model, "architecture_name", type(self.model).__name__)

    def _dtype(self) -> dt.DType:
        return dt.as_dtype(getattr(self.model, "dtype", None) or "float32")

    def _paged_refusal(self) -> str | None:
        """Why a paged KV cache cannot run this model (None: it can). One token through a one-row paged cache must
        give the contiguous probe's logits."""
        layers, kv_heads, head_dim = self._geometry
        if getattr(self.model, "attention_free", False):
            return None  # a pool of no layers: it runs, and saves nothing
        device = self._device() or get_device()
        dtype = self._dtype()
        if not paged_decode_fits(device, head_dim, dtype.name):
            return (f"its head_dim of {head_dim} in {dtype.name} is not a whole number of 16-byte vectors, which "
                    "the paged decode attention reads")
        pool = BlockPool(layers, kv_heads, head_dim, 2, self.page_size, dtype, device)
        try:
            logits = self.model(np.full((1, 1), self.pad, np.int32),
                                cache=PagedKVCache(pool, 1, self.page_size)).logits.numpy()
        except (ValueError, TypeError, VkformersError) as exc:
            return f"its attention does not run on one ({str(exc).splitlines()[0]})"
        expected = self._probe_logits
        if not np.allclose(logits, expected, rtol=1e-2, atol=1e-2 * float(np.abs(expected).max() or 1)):
            return "its attention does not read one (the probe's logits differ)"
        return None

    def _blocks_for_memory(self, fraction: float) -> int:
        """Blocks (the scratch one included) of a pool filling ``fraction`` of the device's memory heap, less the
        buffers held now (the weights) and the activations' reserve; at most what the scheduler could ever hold."""
        layers, kv_heads, head_dim = self._geometry
        device = self._device() or get_device()
        heap = device.memory()
        allowed = fraction * heap["size"] - buffer_memory()["live_bytes"]
        if heap["budget"]:  # the driver's budget for this process: other processes' memory counted
            allowed = min(allowed, heap["budget"] - heap["usage"])
        allowed -= max(ACTIVATION_RESERVE * heap["size"], ACTIVATION_RESERVE_MIN)
        dtype = self._dtype()
        per_block = block_bytes(layers, kv_heads, head_dim, self.page_size, dtype)
        per_layer_block = kv_heads * self.page_size * head_dim * dtype.itemsize
        # every row of a full batch at the column limit, and joining prompts prefilled apart as many again
        most = 2 * self.max_batch * -(-self._column_limit() // self.page_size)
        blocks = min(int(max(allowed, 0) // per_block), most, device.max_buffer_bytes // per_layer_block - 1)
        needed = 2 * -(-self.max_model_len // self.page_size) + 4  # one request of max_model_len, as check() counts
        if blocks < needed:
            raise InputError(f"the KV cache gets {blocks} blocks of {self.page_size} tokens in "
                             f"{max(allowed, 0) / 2**30:.2f} GiB of device memory, and a request of max_model_len "
                             f"{self.max_model_len} needs {needed}; raise the memory share, lower max_model_len, or "
                             "size the cache in tokens")
        return blocks + 1

    def kv_cache_summary(self) -> str:
        """One line on the KV cache: paged (its tokens, blocks and bytes) or contiguous (and why)."""
        if self.kv_blocks is None:
            return self.kv_cache_note or "contiguous KV caches (rows x columns per batch)"
        layers, kv_heads, head_dim = self._geometry
        usable = self.kv_blocks - 1
        size = block_bytes(layers, kv_heads, head_dim, self.page_size, self._dtype()) * self.kv_blocks
        size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        return (f"paged KV cache: {usable * self.page_size:,} tokens ({usable:,} blocks of {self.page_size}), "
                f"{size}; prefix caching {'on' if self.prefix_caching else 'off'}")

    def _refuse_row_state(self) -> None:
        """Continuous batching moves a request's keys, values and recurrent state between cache rows; a model whose
        layers keep other state on the cache (indexer keys), or whose cache is no key/value cache, would answer
        wrongly. One token through a one-row cache tells."""
        name = self._name()
        hint = "; use `vkformers generate` or model.generate() for it"
        if getattr(self.model, "attention_free", False):
            self._geometry = (0, 1, 1)  # no keys or values: the cache carries the rows' recurrent state only
        elif all(hasattr(self.model, a) for a in ("num_layers", "num_kv_heads", "head_dim")):
            self._geometry = (self.model.num_layers, self.model.num_kv_heads, self.model.head_dim)
        else:
            raise InputError(f"{name}: its generation cache is not a key/value cache, which continuous batching "
                             f"needs{hint}")
        layers, kv_heads, head_dim = self._geometry
        probe = _ProbeCache(layers, 1, kv_heads, head_dim, 1, getattr(self.model, "dtype", None) or "float32",
                            self._device())
        self._probe_logits = self.model(np.full((1, 1), self.pad, np.int32), cache=probe).logits.numpy()
        # the gap of a prefix-cached layout must change nothing: positions counted over the tokens alone
        gapped = np.array([[1, 1, 0, 1]], np.int64)
        positions = self.model.generation_positions(gapped, np.full((1, 4), self.pad, np.int64), 4)
        self._column_bound = probe.column_bound or positions[0, [0, 1, 3]].tolist() != [0, 1, 2]
        self._recurrent = bool(probe.layer_state())  # its prompts' state is not in blocks: no prefix caching
        state = probe.fixed_state()
        if state:
            raise InputError(f"{name}: its layers keep {', '.join(state)} on the cache besides keys and values, "
                             f"which continuous batching cannot move between rows yet{hint}")

    # -- the caller's side

    def release_caches(self, timeout: float | None = None) -> bool:
        """Once no request runs (waiting ones first finish): let go of the batch caches kept per row count, their
        recorded decode steps and the plan cache, so that their device memory goes back; later requests record them
        anew. A paged cache's block pool stays. Returns whether that happened within ``timeout`` seconds."""
        if self._thread is None or not self._thread.is_alive():
            self._drop_caches()
            return True
        done = threading.Event()
        with self._cond:
            self._releases.append(done)
            self._cond.notify_all()
        return done.wait(timeout)

    def _drop_caches(self) -> None:
        self._caches.clear()
        self._adapter_scales.clear()
        self._joining_caches.clear()
        self._scoring_caches.clear()
        self._forget_prefills()
        lazy.clear_plan_cache()

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """RequestScheduler.check, and paged: whether the request can ever fit the pool (KVBlocksExhausted)."""
        super().check(prompt_tokens, max_tokens)
        if self.kv_blocks is not None:  # alone in the pool, twice its prompt while it joins (prefilled, then placed)
            # (left padding takes no blocks: wholly masked blocks stay scratch, whatever width prompts are laid out at)
            needed = -(-(prompt_tokens + max_tokens + LOOKAHEAD) // self.page_size) \
                + -(-prompt_tokens // self.page_size) + 2
            if needed > self.kv_blocks - 1:
                raise KVBlocksExhausted(f"the request needs {needed} KV blocks of {self.page_size} tokens and the "
                                        f"cache has {self.kv_blocks - 1}; shorten the prompt or lower max_tokens")

    def _finished_one(self) -> None:
        self._admit_limit = None  # its blocks come back

    # -- warm-up, before the thread starts

    def batch_sizes(self) -> tuple[int, ...]:
        """The row counts of the batches this scheduler runs (_bucket): powers of two below max_batch, and it."""
        sizes, rows = [], 1
        while rows < self.max_batch:
            sizes.append(rows)
            rows *= 2
        return (*sizes, self.max_batch)

    def default_warmup(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (batch sizes, prompt widths) that warm_up records by default: on a GPU, every batch size, and the
        widths prompts up to WARMUP_CHUNKS chunks long are laid out at (as many as WARMUP_PREFILL_PLANS allows, each
        alone and joining a batch); on a CPU device none, since prompts there are laid out at their own lengths."""
        device = self._device() or get_device()
        if device.is_cpu:
            return (), ()
        sizes = self.batch_sizes() if self._replays() else ()
        widths, plans = [], 0
        if self._prefills_replay_by_width():
            exact = self.model.prompt_padding_is_exact
            longest = WARMUP_CHUNKS * self._chunk_columns(1, PREFILL_CHUNK)
            for width in self._layout_widths(min(longest, self.max_model_len - 1)):
                plans += self._warmup_paths() * self._chunks(1, width)
                if width > longest or not exact(1, width) or plans > WARMUP_PREFILL_PLANS:
                    break
                widths.append(width)
        if self.kv_blocks is None:
            sizes = self._affordable_batch_sizes(sizes, widths, WARMUP_CONTIGUOUS_SHARE * device.memory()["size"])
        return sizes, tuple(widths)

    def _affordable_batch_sizes(self, sizes, widths, budget: float) -> tuple[int, ...]:
        """The smallest of ``sizes`` whose contiguous caches, wide enough for prompts of ``widths`` as the warm-up
        makes them, take at most ``budget`` bytes together."""
        layers, kv_heads, head_dim = self._geometry
        per_row = block_bytes(layers, kv_heads, head_dim, self._columns(max(widths, default=self._width(1))
                                                                        + CACHE_GROWTH), self._dtype())
        kept, total = [], 0
        for rows in sorted(sizes):
            total += rows * per_row
            if total > budget:
                break
            kept.append(rows)
        return tuple(kept)

    def warm_up(self, batch_sizes=None, prompt_widths=None) -> WarmupReport:
        """Record the decode steps and prefills the first requests replay, before ``start()``: decode steps of
        batches of each of ``batch_sizes`` rows, and prefills of a prompt laid out at each of ``prompt_widths``
        columns, alone and joining a running batch (None: default_warmup's). Synthetic requests run through the
        scheduler's turns on this thread; afterwards no KV block is held, no prefix registered, and the metrics
        are as they were. Returns what it recorded."""
        if self._thread is not None:
            raise WarmupError("warm_up() runs before start(): then the scheduler's thread alone runs the model")
        sizes, widths = self._warmup_shapes(batch_sizes, prompt_widths)
        if not sizes and not widths:
            return WarmupReport()
        began = time.perf_counter()
        if self.kv_blocks is not None:
            self._block_pool()  # allocated first: the memory measured below is the warm-up's own
        held = buffer_memory()["live_bytes"]
        saved = {f.name: getattr(self.metrics, f.name) for f in fields(self.metrics)}
        skipped: list[str] = []
        self._warmup_prefills_run = set()
        self._warming = True
        try:
            with no_grad():
                # contiguous caches sized for a batch of prompts up to the widest (a larger one, made later, would
                # start without the recorded steps); a paged cache's columns cost nothing until used
                widest = max(widths, default=self._width(1))
                for rows in sorted({*sizes, *((1, 2) if widths else ())} & set(self.batch_sizes())):
                    self._cache(rows, widest + CACHE_GROWTH)
                if widths and self._warmup_paths() > 1:
                    self._prefill_cache(1, widest)
                sizes = self._warm_decode_steps(sizes, skipped)
                joining = bool(widths) and self._warmup_paths() > 1 and self._warm_joining_prefills(widths, skipped)
                self._warm_alone_prefills(widths)
        finally:
            self._warming, self._admit_limit = False, None
            self._release_rows()
            self._drop_unconfirmed_prefills()
            for name, value in saved.items():
                setattr(self.metrics, name, value)
            self._count_blocks()
        if self._pool is not None and (self._pool.used_blocks or self._pool.cached_blocks):
            raise WarmupError(f"the warm-up left {self._pool.used_blocks} KV blocks held and "
                              f"{self._pool.cached_blocks} registered")
        shapes = len(self._warmup_prefills_run)
        plans = len(self._warmed_prefills & self._warmup_prefills_run)
        return WarmupReport(tuple(sizes), tuple(widths), joining, plans, shapes, time.perf_counter() - began,
                            buffer_memory()["live_bytes"] - held, tuple(skipped))

    def _warmup_shapes(self, batch_sizes, prompt_widths) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The batch sizes and prompt widths to warm up, checked: WarmupError for ones the scheduler never runs."""
        sizes, widths = self.default_warmup()
        if batch_sizes is not None:
            sizes = _whole_numbers(batch_sizes, "batch sizes")
        if prompt_widths is not None:
            widths = _whole_numbers(prompt_widths, "prompt widths")
        allowed = self.batch_sizes()
        wrong = [n for n in sizes if n not in allowed]
        if wrong:
            raise WarmupError(f"warm-up batch size {wrong[0]}: the scheduler runs batches of "
                              f"{', '.join(map(str, allowed))} rows (powers of two below max_batch, and max_batch)")
        if sizes and not self._replays():
            raise WarmupError(f"{self._name()}: its decode steps are not replayed, so there is none to warm up; "
                              "give no batch sizes")
        if widths and not self._prefills_replay_by_width():
            raise WarmupError(f"{self._name()}: its prefills replay only for prompts of one length, or not at all, "
                              "which a warm-up cannot foresee; give no prompt widths")
        for width in widths:
            if self._warmup_length(width) is None:
                some = self._layout_widths(self.max_model_len - 1)
                listed = ", ".join(map(str, some[:6])) + (", ..." if len(some) > 6 else "")
                raise WarmupError(f"warm-up prompt width {width}: prompts of up to max_model_len "
                                  f"{self.max_model_len} tokens are laid out at {listed} columns")
        plans = self._warmup_paths() * sum(self._chunks(1, w) for w in widths)
        if plans > WARMUP_PREFILL_PLANS:
            raise WarmupError(f"warm-up prompt widths {', '.join(map(str, widths))}: {plans} prefill plans (alone "
                              f"and joining a batch, one per chunk), more than a warm-up holds "
                              f"(WARMUP_PREFILL_PLANS {WARMUP_PREFILL_PLANS}); give fewer")
        return sizes, widths

    def _prefills_replay_by_width(self) -> bool:
        """Whether prompts of one width replay one prefill plan whatever their length (_prefill_capture's key
        holds no length): then a warm-up prompt records the plan of every prompt of its width."""
        model = self.model
        return (self._replays() and getattr(model, "recompute_cache_beyond", None) is None and not self._recurrent
                and getattr(model, "prompt_padding_is_exact", None) is not None)

    def _warmup_paths(self) -> int:
        """How a prompt is prefilled in the warm-up: alone (a rebuild of one row) and, where a batch can have a row
        to spare (max_batch above 1), joining it."""
        return 2 if self.max_batch > 1 else 1

    def _chunks(self, rows: int, width: int) -> int:
        return -(-width // self._chunk_columns(rows, width))

    def _layout_widths(self, longest: int) -> list[int]:
        """The widths prompts of 1 to ``longest`` tokens are laid out at (_width), narrowest first."""
        widths, length = [], 1
        while length <= longest:
            widths.append(self._width(length))
            length = max(widths[-1], length) + 1
        return widths

    def _warmup_length(self, width: int) -> int | None:
        """The shortest prompt laid out at ``width`` columns that leaves room for a token (None: none is)."""
        low, high = 1, min(width, self.max_model_len - 1)
        if high < 1 or self._width(high) < width:
            return None
        while low < high:  # (_width never decreases with the length)
            middle = (low + high) // 2
            if self._width(middle) >= width:
                high = middle
            else:
                low = middle + 1
        return low if self._width(low) == width else None

    def _warmup_request(self, length: int, max_tokens: int) -> Request:
        """A greedy request of ``length`` pad tokens that never stops before ``max_tokens`` (no end token)."""
        return Request([self.pad] * length, SamplingParams(max_tokens=max_tokens, temperature=0), lambda update: None,
                       ())

    def _warmup_fits(self, requests: list[Request]) -> bool:
        """Whether the pool surely has the blocks of the warm-up's ``requests`` (each prefilled, and placed)."""
        if self.kv_blocks is None:
            return True
        need = sum(2 * -(-(len(r.prompt) + r.params.max_tokens + LOOKAHEAD) // self.page_size) + 2 for r in requests)
        return need <= self._block_pool().free_blocks

    def _warm_decode_steps(self, sizes: tuple[int, ...], skipped: list[str]) -> list[int]:
        """Batches of each of ``sizes`` rows decoding until their step replays (their prefills then dropped: a
        batch of short prompts, not what comes); returns the sizes warmed up."""
        warmed, short = [], []
        for rows in sizes:
            # rows of two lengths: masked columns, as a batch of prompts of several lengths has
            requests = [self._warmup_request(1 + row % 2, WARMUP_DECODE_TOKENS) for row in range(rows)]
            if 2 + WARMUP_DECODE_TOKENS > self.max_model_len or not self._warmup_fits(requests):
                short.append(rows)
                continue
            self._release_rows()  # an idle server: the requests are rebuilt as one batch
            self._drive(requests)
            self._drop_unconfirmed_prefills()
            warmed.append(rows)
        if short:
            skipped.append(f"decode steps of {', '.join(map(str, short))} rows skipped (too few KV blocks or "
                           "max_model_len tokens)")
        return warmed

    def _warm_joining_prefills(self, widths: tuple[int, ...], skipped: list[str]) -> bool:
        """Each width's prompt prefilled twice into the joining cache of one row and placed into the free row of a
        running batch of two (as wide as the widest prompt, so that none moves it). False where it could not."""
        widest = self._warmup_length(max(widths))
        runs = self._warmup_request(widest, 2 + 2 * sum(self._chunks(1, w) for w in widths))
        leaves = self._warmup_request(1, 1)  # done at its first token: its row is free
        if widest + runs.params.max_tokens > self.max_model_len or not self._warmup_fits([runs, leaves]):
            skipped.append("prefills joining a batch skipped (too few KV blocks or max_model_len tokens)")
            return False
        self._release_rows()
        self._drive([runs, leaves], until=[leaves])
        self._drop_unconfirmed_prefills()  # the batch's own prefill
        placements = self.metrics.placements
        for width in widths:
            for _ in range(2):  # recorded, then confirmed
                self._drive([self._warmup_request(self._warmup_length(width), 1)])
            self._keep_warmed_prefills()
        runs.cancel()
        self._drive([], until=[runs])
        if self.metrics.placements - placements != 2 * len(widths):  # (not expected: rebuilt with the batch)
            skipped.append("prefills joining a batch were rebuilt with it instead")
            return False
        return True

    def _warm_alone_prefills(self, widths: tuple[int, ...]) -> None:
        """Each width's prompt prefilled twice alone, as an idle server's first request is (a rebuild of one row)."""
        for width in widths:
            for _ in range(2):
                self._release_rows()
                self._drive([self._warmup_request(self._warmup_length(width), 1)])
            self._keep_warmed_prefills()

    def _keep_warmed_prefills(self) -> None:
        """The prefill captures confirmed so far (the warm-up's, which runs first) are held beside PREFILL_PLANS;
        the shapes run so far noted (chunks of two widths may share one: a left-padded prompt's first chunk)."""
        self._warmup_prefills_run |= set(self._prefill_captures)
        self._warmed_prefills |= {key for key, (capture, _) in self._prefill_captures.items() if capture.ready}

    def _drive(self, requests: list[Request], until: list[Request] | None = None) -> None:
        """Submit the warm-up's ``requests`` and run the scheduler's turns on this thread until ``until`` (default:
        those requests) finished; WarmupError where a turn failed."""
        self.submit_all(requests)
        until = requests if until is None else until
        errors = self.metrics.errors
        for _ in range(WARMUP_TURNS):
            if all(r.finished for r in until):
                return
            with self._cond:
                self._joining = self._admit()
            self._turn()
            if self.metrics.errors != errors:
                first = str(self.last_error).splitlines()[0] if str(self.last_error) else type(self.last_error).__name__
                raise WarmupError(f"the warm-up failed: {first}")
        raise WarmupError(f"the warm-up's requests did not finish in {WARMUP_TURNS} turns")

    def _drop_unconfirmed_prefills(self) -> None:
        """Drop the prefill captures that replay nothing yet (the warm-up batches' own prefills, run once), and
        their plans from the plan cache: shapes of short synthetic prompts, not what comes."""
        for key, (capture, _) in list(self._prefill_captures.items()):
            if not capture.ready:
                del self._prefill_captures[key]
                self._warmed_prefills.discard(key)
                plan = capture.previous[0] if capture.previous is not None else None
                capture.forget()
                if plan is not None:
                    lazy.evict_plan(plan)

    # -- the scheduler's thread

    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closing and not self._waiting and not self._live() and self._prefilling is None \
                            and self._scoring is None:
                        self._release_rows()
                        if self._releases:  # idle: nothing reads the caches now
                            self._drop_caches()
                            for done in self._releases:
                                done.set()
                            self._releases.clear()
                        self._cond.wait()
                    if self._closing:
                        return
                    self._joining = self._admit()
                self._turn()
        except BaseException as exc:  # the thread ends: no request may wait for it
            self.error = exc
            with self._cond:
                self._fail(self._waiting + self._held_requests())
                self._waiting.clear()
            raise

    def _turn(self) -> None:
        """Admit waiting requests, or run one decode step. A failure fails the requests of the batch (each gets an
        "error" update) and drops the batch and its recorded steps; the next requests start a new one."""
        try:
            if self._joining:
                fits = self._state is not None and self._fits(self._joining)
                if self._state is not None and not fits and self._compact_tables():  # paged: columns given back
                    fits = self._fits(self._joining)
                if fits and self._blocks_free(self._joining, True):
                    self._start_prefill(self._joining)
                else:
                    admitted = self._fitting(self._joining)
                    self._requeue(self._joining[len(admitted):])  # paged: the others wait for blocks
                    self._joining = admitted
                    if admitted:
                        self._rebuild(admitted)
            if self._to_score:
                self._start_scoring()
            if self._scoring is not None:
                self._score_chunk()
            decoding = self._state is not None and any(r is not None and not r.finished for r in self._rows)
            if self._prefilling is not None:
                self._prefill_chunk()
                if self._prefilling is not None and decoding:
                    self._step()
            elif not self._joining and decoding:  # (none may be: the waiting requests were all cancelled)
                self._step()
        except KVBlocksExhausted:  # paged, not foreseen: every request waits again, recomputed when it rejoins
            with self._cond:
                requests = [r for r in self._held_requests() if not r.finished]
            self.metrics.preemptions += len(requests)
            self._admit_limit = max(1, min(self._admit_limit or len(requests), len(requests)) // 2)
            self._requeue(sorted(requests, key=lambda r: r.arrived))
            self._prefilling = self._scoring = None
            self._release_rows()
            for cache in [c for c, _, _ in self._caches.values()] + list(self._joining_caches.values()) \
                    + list(self._scoring_caches.values()):
                cache.reset()
            self._count_blocks()
        except Exception as exc:
            self.last_error = exc
            self.metrics.errors += 1
            with self._cond:
                self._fail(self._held_requests())
            self._prefilling = self._scoring = None
            self._release_rows()
            self._caches.clear()
            self._joining_caches.clear()
            self._scoring_caches.clear()
            self._forget_prefills()
            self._pool = None  # (its blocks may be held by the dropped caches)
        finally:
            self._joining, self._to_score = [], []

    def _held_requests(self) -> list[Request]:
        """The requests this turn held (in rows, joining, being prefilled or scored), each once: a failure answers
        them."""
        prefilling = self._prefilling.requests if self._prefilling is not None else []
        scoring = self._scoring.requests if self._scoring is not None else []
        held = [r for r in self._rows + self._joining + prefilling + self._to_score + scoring if r is not None]
        return list({id(r): r for r in held}.values())

    def _live(self) -> list[Request]:
        live = []
        for request in self._rows:
            if request is None or request.finished:
                continue
            if request.cancelled:
                self._finish(request, FINISH_CANCELLED)
                continue
            live.append(request)
        return live

    def _release_rows(self) -> None:
        """Nothing runs: let the batch go (its cache stays allocated for the next; a paged one gives its blocks
        back)."""
        if self._state is not None and self._state[0].paged:
            self._state[0].reset()
        self._rows, self._state = [], None
        self.metrics.batch_rows = self.metrics.live_rows = self.metrics.cache_tokens = 0
        self._count_blocks()

    def _count_blocks(self) -> None:
        if self._pool is not None:
            self.metrics.kv_blocks_used = self._pool.used_blocks
            self.metrics.kv_blocks_cached = self._pool.cached_blocks
            self.metrics.kv_blocks_evicted = self._pool.evictions

    def _free_rows(self) -> None:
        """Paged: the rows of requests that left give their blocks back."""
        if self._state is not None and self._state[0].paged:
            cache = self._state[0]
            gone = [row for row, r in enumerate(self._rows) if (r is None or r.finished) and not cache.dead[row]]
            if gone:
                cache.release_rows(gone)
        self._count_blocks()

    def _blocks_free(self, joining: list[Request], place: bool) -> bool:
        """Paged: whether the pool has the blocks the joining requests need, prefilled apart and placed
        (``place``), or in a rebuild of the whole batch (which gives the running batch's blocks back first)."""
        if self.kv_blocks is None:
            return True
        pool = self._block_pool()
        cache = self._state[0] if self._state is not None else None

        def blocks(tokens):
            return -(-(tokens + LOOKAHEAD) // self.page_size) + 1
        if place:  # (and the joining cache's filler rows: one token each)
            fillers = self._bucket(len(joining)) - len(joining)
            return 2 * sum(blocks(len(r.prompt) + len(r.generated)) for r in joining) + fillers * blocks(1) \
                + len(self._rows) <= pool.free_blocks
        with self._cond:
            live = self._live()
        held = cache.blocks_held if cache is not None else 0
        fillers = self._bucket(len(live) + len(joining)) - len(live) - len(joining)
        return sum(blocks(len(r.prompt) + len(r.generated)) for r in live + joining) + fillers * blocks(1) \
            <= pool.free_blocks + held

    def _fitting(self, joining: list[Request]) -> list[Request]:
        """The first joining requests whose blocks a rebuild has (all but with a paged cache); at least one when
        nothing runs (submit's check says one fits the pool alone)."""
        count = len(joining)
        while count and not self._blocks_free(joining[:count], False):
            count -= 1
        if count == 0 and joining and not self._live():
            count = 1
        return joining[:count]

    def _requeue(self, requests: list[Request]) -> None:
        with self._cond:
            self._waiting[:0] = [r for r in requests if not r.finished]
            self.metrics.waiting = len(self._waiting)

    def _admit(self) -> list[Request]:
        """Waiting requests that join the batch now, as many as max_batch allows (called under the lock); none
        while joining prompts are being prefilled. Those whose prompts are to be scored first wait for it: while no
        prompt is being scored, the first max_batch of them (or as many as the admission limit of a pool that ran
        out allows) are taken for it (``_to_score``). A request of no output tokens that is not to be scored is done
        at once."""
        live = self._live()
        joining = []
        limit = self.max_batch if self._admit_limit is None else self._admit_limit
        if self._scoring is None and not self._to_score:
            kept = []
            for request in self._waiting:
                if request.needs_scoring and request.cancelled:
                    self._finish(request, FINISH_CANCELLED)
                elif request.needs_scoring and len(self._to_score) < limit:
                    self._to_score.append(request)
                else:
                    kept.append(request)
            self._waiting[:] = kept
        if self._prefilling is not None:
            self.metrics.waiting = len(self._waiting)
            return joining
        kept = []
        while self._waiting and len(live) + len(joining) < limit:
            request = self._waiting.pop(0)
            if request.cancelled:
                self._finish(request, FINISH_CANCELLED)
            elif request.needs_scoring:
                kept.append(request)
            elif request.params.max_tokens <= len(request.generated):
                self._finish(request, FINISH_LENGTH)  # max_tokens 0: the prompt alone
            else:
                joining.append(request)
        self._waiting[:0] = kept
        self.metrics.waiting = len(self._waiting)
        return joining

    def _bucket(self, count: int) -> int:
        rows = 1
        while rows < count:
            rows *= 2
        return min(rows, self.max_batch) if count <= self.max_batch else count

    def _columns(self, length: int) -> int:
        return min(-(-length // COLUMN_ROUNDING) * COLUMN_ROUNDING, self._column_limit())

    def _column_limit(self) -> int:
        return -(-COLUMN_LIMIT * self.max_model_len // COLUMN_ROUNDING) * COLUMN_ROUNDING

    def _block_pool(self) -> BlockPool:
        if self._pool is None:
            model = self.model
            self._pool = BlockPool(*self._geometry, self.kv_blocks, self.page_size,
                                   getattr(model, "dtype", None) or "float32", self._device())
        return self._pool

    def _new_cache(self, rows: int, length: int) -> KVCache:
        model = self.model
        if self.kv_blocks is not None:  # memory follows the tokens: the columns cost nothing until used
            cache = PagedKVCache(self._block_pool(), rows, self._column_limit())
        else:
            layers, kv_heads, head_dim = self._geometry
            cache = KVCache(layers, rows, kv_heads, head_dim, self._columns(length),
                            getattr(model, "dtype", None) or "float32", self._device())
        if self._recurrent:
            cache.keep_states_in_place()  # the decode step reads and writes the same buffers: it can be replayed
        cache.padding_is_layout = True  # rows are left-padded to share columns: the padding is no request's text
        return cache

    def _cache(self, rows: int, length: int):
        """A reset cache of ``rows`` rows holding at least ``length`` tokens, with the decode capture recorded on
        it (kept per row count, so that batches of a size seen before replay their recorded step)."""
        held = self._caches.get(rows)
        if held is None or held[0].max_len < length:
            if held is not None:
                self._forget_prefills(held[0])
            self._caches.pop(rows, None)
            del held  # free the old buffers before allocating new ones
            held = (self._new_cache(rows, length), None, None)
        cache, capture, key = held
        new_key = capture_key(self.model, cache)
        if capture is None or new_key is None or new_key != key:
            capture = DecodeCapture(cache)
        self._caches[rows] = (cache, capture, new_key)
        cache.reset()
        return cache, capture

    def _prefill_cache(self, rows: int, length: int, kept: dict | None = None) -> KVCache:
        """A reset cache that prompts joining a running batch are prefilled into, kept per row count (in ``kept``:
        those of another use, the scoring of prompts)."""
        kept = self._joining_caches if kept is None else kept
        cache = kept.get(rows)
        if cache is None or cache.max_len < length:
            if cache is not None:
                self._forget_prefills(cache)
            kept.pop(rows, None)
            del cache
            cache = kept[rows] = self._new_cache(rows, length)
        cache.reset()
        return cache

    def _width(self, longest: int) -> int:
        """The length prompts of up to ``longest`` tokens are prefilled at: on a GPU rounded up to PREFILL_BUCKET
        (more left padding), so that prompts of similar lengths replay one recorded prefill plan; with
        PREFILL_POWERS_OF_TWO further up to a power of two below PREFILL_CHUNK and to whole chunks above it (fewer
        shapes: more of them replayed, for more padding)."""
        device = self._device()
        bucket = PREFILL_BUCKET["cpu" if device is None or device.is_cpu else "gpu"]
        if not bucket:
            return longest
        width = -(-longest // bucket) * bucket
        if PREFILL_POWERS_OF_TWO:
            chunk = max(PREFILL_CHUNK, bucket)
            width = 1 << (width - 1).bit_length() if width < chunk else -(-width // chunk) * chunk
        # never so far that the batch's columns (COLUMN_LIMIT) leave the longest request too little room for what it
        # may still generate (max_model_len tokens in all): it would be packed again, at worst after every token
        return min(width, self._column_limit() - self.max_model_len + longest)

    def _device(self):
        params = self.model.parameters() if hasattr(self.model, "parameters") else []
        return params[0].device if params else None

    def _left_padded(self, histories: list[list[int]], rows: int, exact: bool = False):
        """ids and mask [rows, width] of the token lists, left-padded; filler rows hold one pad token. The width:
        _width's of the longest (``exact``: the longest's own)."""
        histories = histories + [[self.pad]] * (rows - len(histories))
        longest = max(len(h) for h in histories)
        length = longest if exact else self._width(longest)
        ids = np.full((rows, length), self.pad, np.int64)
        mask = np.zeros((rows, length), np.int64)
        for row, history in enumerate(histories):
            ids[row, length - len(history):] = history
            mask[row, length - len(history):] = 1
        return ids, mask

    def _rebuild(self, joining: list[Request]) -> None:
        """Prefill every live request's tokens so far (prompt and generated) and the joining prompts as one
        left-padded batch; each request then takes its next token from the prefill's logits."""
        with self._cond:
            live = self._live() + joining
        rows = self._bucket(len(live))
        if self._state is not None and self._state[0].paged:
            self._state[0].reset()  # everything is prefilled again: its blocks first (its cached ones stay)
        layout = self._layout(live, rows)
        ids, mask = layout.ids, layout.mask
        length = ids.shape[1]
        remaining = max(r.params.max_tokens - len(r.generated) for r in live)
        cache, capture = self._cache(rows, length + min(remaining, CACHE_GROWTH))
        self._take_prefix(cache, layout, len(live))
        positions = self.model.generation_positions(mask, ids, length)
        start, columns = layout.start, self._chunk_columns(rows, length - layout.start)
        while True:  # in chunks of at most PREFILL_TOKENS tokens; the last chunk's logits choose the next tokens
            end = min(start + columns, length)
            logits = self._prefill(ids[:, start:end], mask[:, :end], positions[:, start:end], cache, live)
            start = end
            if end == length:
                break
        self._register_prefix(cache, layout, len(live))
        self._state = (cache, capture, ids, mask, length)
        self._rows = live + [None] * (rows - len(live))
        self.metrics.rebuilds += 1
        self.metrics.batch_rows, self.metrics.live_rows = rows, len(live)
        self.metrics.cache_tokens = rows * cache.max_len
        self._choose(logits, list(enumerate(live)))
        self._free_rows()

    def _fits(self, joining: list[Request]) -> bool:
        """Whether the joining requests can take free rows of the running batch: as many free rows, and columns
        to spare for their prompts and first outputs (a prompt longer than the batch's columns so far shifts the
        batch right, _move)."""
        position = self._state[0].position
        start = max(position, self._width(max(len(r.prompt) + len(r.generated) for r in joining)))
        free = sum(1 for r in self._rows if r is None or r.finished)
        if self.kv_blocks is not None and start > position:
            if not self._moves_tables():
                return False  # moving the batch right would copy it, twice its blocks: a rebuild instead
            start = position + -(-(start - position) // self.page_size) * self.page_size  # whole blocks
        return len(joining) <= free and all(
            start + min(r.params.max_tokens - len(r.generated), CACHE_GROWTH) <= self._column_limit() for r in joining)

    def _start_prefill(self, joining: list[Request]) -> None:
        layout = self._layout(joining, self._bucket(len(joining)))
        ids, mask = layout.ids, layout.mask
        positions = self.model.generation_positions(mask, ids, ids.shape[1])
        cache = self._prefill_cache(ids.shape[0], ids.shape[1])
        self._take_prefix(cache, layout, len(joining))
        self._prefilling = _Prefill(joining, layout, positions, cache, layout.start)

    def _prefill_chunk(self) -> None:
        """The next chunk of the joining prompts (_chunk_columns); after the last, they join (_place)."""
        job = self._prefilling
        ids, mask = job.layout.ids, job.layout.mask
        start, width = job.done, ids.shape[1]
        end = min(start + self._chunk_columns(ids.shape[0], width - start), width)
        logits = self._prefill(ids[:, start:end], mask[:, :end], job.positions[:, start:end], job.cache, job.requests)
        job.done = end
        self.metrics.prefill_chunks += 1
        if end == width:
            self._register_prefix(job.cache, job.layout, len(job.requests))
            self._place(job.requests, ids, job.cache, logits)
            self._prefilling = None  # placed (until then a failure finds the requests here: they are in no row)

    def _start_scoring(self) -> None:
        """Lay out the requests taken for scoring (``_to_score``) as one batch in a cache of their own, no prefix
        taken from the prefix cache (every position's logits are wanted). Paged: those whose blocks the pool has not
        now wait again (one always goes when no block is held: submit's check says a request fits alone)."""
        requests = self._to_score
        count = len(requests)
        if self.kv_blocks is not None:
            pool = self._block_pool()

            def blocks(taken):  # at most: a chunk takes every row's blocks LOOKAHEAD columns past it, padding or not
                width = max(len(r.prompt) for r in requests[:taken])
                return self._bucket(taken) * -(-(width + LOOKAHEAD) // self.page_size)
            while count and blocks(count) > pool.free_blocks:
                count -= 1
            if count == 0 and pool.used_blocks == 0:
                count = 1
        self._requeue(requests[count:])
        self._to_score = requests = requests[:count]
        if not requests:
            return
        # rows rounded up as a batch's are (filler rows: one pad token), so that a few caches serve every count
        layout = self._layout(requests, self._bucket(len(requests)), scoring=True)
        positions = self.model.generation_positions(layout.mask, layout.ids, layout.ids.shape[1])
        cache = self._prefill_cache(*layout.ids.shape, self._scoring_caches)
        self._take_prefix(cache, layout, len(requests))  # (nothing taken: the filler rows' blocks given back)
        self._scoring = _Scoring(requests, layout, positions, cache, entries=[[] for _ in requests])
        self._to_score = []

    def _score_chunk(self) -> None:
        """The next chunk of the prompts being scored: the model's logits at every position of the chunk (at most
        PROMPT_LOGITS; no recorded plan, which keeps the last position's only), each prompt token's entry from the
        position before it. After the last chunk each request gets its prompt's entries (an update of their own),
        takes its first token from its last position's logits and waits to join the batch with it (or is done:
        max_tokens 1, or 0); its prompt's full blocks are offered to later prompts, its own join among them."""
        job = self._scoring
        if all(r.cancelled for r in job.requests):  # no one waits for them: the job ends here
            for request in job.requests:
                self._finish(request, FINISH_CANCELLED)
            job.cache.reset()
            self._scoring = None
            self._count_blocks()
            return
        ids, mask = job.layout.ids, job.layout.mask
        rows, width = ids.shape
        start = job.done
        vocab = self.vocab_size
        end = min(start + min(self._chunk_columns(rows, width - start), max(PROMPT_LOGITS // (rows * vocab), 1)),
                  width)
        began = time.perf_counter()
        with self._selecting(job.requests, rows):
            out = self.model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=job.positions[:, start:end],
                             cache=job.cache)
            logits = to_scores(out.logits.numpy())  # [rows, columns, vocab]
            del out
        for row, request in enumerate(job.requests):
            columns = np.nonzero(mask[row])[0]  # the prompt's tokens, in order
            # the position of token i gives the entry of token i + 1
            picked = np.nonzero((columns[:-1] >= start) & (columns[:-1] < end))[0]
            if picked.size:
                job.entries[row] += _prompt_logprobs(logits[row, columns[picked] - start],
                                                     np.asarray(request.prompt)[picked + 1],
                                                     request.params.prompt_logprobs)
        job.done = end
        self.metrics.prefill_seconds += time.perf_counter() - began
        self.metrics.prefills += 1
        if end < width:
            return
        self._register_prefix(job.cache, job.layout, len(job.requests))
        job.cache.reset()  # its blocks back to the pool (those registered stay cached)
        self._count_blocks()
        choosing = []
        for row, request in enumerate(job.requests):
            request.scored = True
            self.metrics.prompt_logprob_tokens += len(request.prompt)
            if request.cancelled:
                self._finish(request, FINISH_CANCELLED)
                continue
            first = TokenLogprob(request.prompt[0], None, [])
            request.on_update(Update("", [], None, 0, prompt_logprobs=[first] + job.entries[row]))
            if request.params.max_tokens == 0:
                self._finish(request, FINISH_LENGTH)
            else:
                choosing.append((row, request))
        self._choose(logits[:, -1], choosing)  # every row's prompt ends at the last column
        self._scoring = None
        self._requeue([request for _, request in choosing])

    def _prefill(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: KVCache,
                 requests: list[Request] = ()) -> np.ndarray:
        """One prefill forward of ``ids`` [rows, T] into ``cache`` (``mask`` over its stored tokens and these) for
        the ``requests`` of its first rows (the others: the base model): the last column's logits. Replays the
        recorded plan of earlier prefills of its shape where it can."""
        began = time.perf_counter()
        capture = self._prefill_capture(ids, mask, positions, cache)
        replays = capture.replays if capture is not None else 0
        with self._selecting(requests, ids.shape[0]):
            logits = self.model.prefill(ids, mask, positions, cache, capture)
        self.metrics.prefill_seconds += time.perf_counter() - began
        self.metrics.prefills += 1
        self.metrics.prefill_replays += (capture.replays if capture is not None else 0) - replays
        return logits

    def _prefill_capture(self, ids, mask, positions, cache: KVCache) -> DecodeCapture | None:
        """The capture that prefills of this shape share, or None where none may: the model must replay its steps
        as the decode step does (_replays) and recompute nothing past a length (recompute_cache_beyond). Its key
        holds all the forward's graph depends on beyond its inputs (ids, positions, the cache's bounds, tables and
        mask): the cache, the rows, the columns, the stored columns, whether any column is masked; the longest
        position where the rotary tables depend on it (prompt_padding_is_exact says where they do not); and for
        layers of recurrent state, which zero the masked columns with an input of their own, the mask itself."""
        model = self.model
        if not self._replays() or getattr(model, "recompute_cache_beyond", None) is not None:
            return None
        params = capture_key(model, cache)
        if params is None:
            return None
        start, (rows, columns) = cache.position, ids.shape
        end = start + columns
        longest = int(positions.max()) + 1
        exact = getattr(model, "prompt_padding_is_exact", None)
        tag = None if exact is not None and longest <= end and exact(longest, end) else longest
        masked = not mask[:, :end].all()
        state = mask[:, :end].tobytes() if self._recurrent and masked else None
        key = (id(cache), rows, columns, start, masked, tag, state)
        held = self._prefill_captures.pop(key, None)
        capture = held[0] if held is not None and held[1] == params and held[0].cache is cache else None
        if capture is None:
            if held is not None:
                held[0].forget()
            capture = DecodeCapture(cache, tokens=columns)
        self._prefill_captures[key] = (capture, params)  # most recently used last
        self._trim_prefills()
        return capture

    def _trim_prefills(self) -> None:
        """Drop the least recently used prefill captures past PREFILL_PLANS (those of warm_up's shapes kept beside
        them: a burst of other shapes would push them all out before their requests came), or while the plans they
        all hold exceed lazy.MAX_PLAN_BYTES (the newest stays)."""
        captures = self._prefill_captures

        def held_bytes():
            return sum(c.previous[0].nbytes for c, _ in captures.values() if c.previous is not None)
        while len(captures) > 1:
            live = [key for key in captures if key not in self._warmed_prefills]
            if len(live) > max(PREFILL_PLANS, 1):
                oldest = live[0]
            elif held_bytes() > lazy.MAX_PLAN_BYTES:
                oldest = next(iter(captures))
            else:
                return
            self._warmed_prefills.discard(oldest)
            captures.pop(oldest)[0].forget()

    def _forget_prefills(self, cache: KVCache | None = None) -> None:
        """Drop the prefill captures recorded on ``cache`` (None: all), letting their plans and the cache go."""
        for key, (capture, _) in list(self._prefill_captures.items()):
            if cache is None or capture.cache is cache:
                del self._prefill_captures[key]
                self._warmed_prefills.discard(key)
                capture.forget()

    @staticmethod
    def _chunk_columns(rows: int, columns: int) -> int:
        """Columns of a prefill chunk of ``rows`` rows: at most PREFILL_CHUNK, and at most PREFILL_TOKENS tokens in
        all (a multiple of 16 columns where that leaves any); never fewer than one."""
        width = min(max(PREFILL_CHUNK, 1), max(PREFILL_TOKENS // rows, 1))
        if width > 16:
            width -= width % 16
        return min(width, columns) if columns > 0 else width

    def _layout(self, requests: list[Request], rows: int, scoring: bool = False) -> _Layout:
        """The requests' tokens so far (prompt and generated) as ``rows`` rows (filler rows: one pad token).
        Without prefix caching, left-padded. With it: each prompt's full blocks from column 0, a masked gap, the
        rest ending at the last column; ``start``: the columns every request finds in the prefix cache (a whole
        number of blocks, and at least one token left to prefill). ``scoring`` (_start_scoring): nothing taken from
        the prefix cache, and the longest request as wide as it is (no recorded plan to share)."""
        histories = [r.prompt + r.generated for r in requests]
        queried = sum(len(h) for h in histories)
        if not self.prefix_caching:
            self.metrics.prefill_tokens += queried
            ids, mask = self._left_padded(histories, rows, exact=scoring)
            return _Layout(ids, mask)
        size, pool = self.page_size, self._block_pool()
        keys = [prefix_keys(r.prompt, size, self._adapter_salts[r.adapter]) for r in requests]
        aligned = [min(len(k), (len(h) - 1) // size) for k, h in zip(keys, histories)]
        hits = 0 if scoring else min(pool.cached_prefix(k[:a]) for k, a in zip(keys, aligned))
        longest = max(len(h) for h in histories)
        width = longest if scoring else self._width(longest)
        ids = np.full((rows, width), self.pad, np.int64)
        mask = np.zeros((rows, width), np.int64)
        for row, (history, blocks) in enumerate(zip(histories, aligned)):
            cut = blocks * size
            rest = history[cut:]
            ids[row, :cut], ids[row, width - len(rest):] = history[:cut], rest
            mask[row, :cut] = 1
            mask[row, width - len(rest):] = 1
        mask[len(requests):, -1] = 1
        hit_tokens = hits * size * len(requests)
        if not scoring:
            self.metrics.prefix_queried_tokens += queried
            self.metrics.prefix_hit_tokens += hit_tokens
        self.metrics.prefill_tokens += queried - hit_tokens
        return _Layout(ids, mask, hits * size, tuple(keys), tuple(aligned))

    def _take_prefix(self, cache: KVCache, layout: _Layout, live: int) -> None:
        """Put the cached blocks of the layout's first ``start`` columns into the requests' rows of the reset
        ``cache``; filler rows take no blocks."""
        if not self.prefix_caching:
            return
        cache.release_rows(range(live, cache.batch))
        blocks = layout.start // self.page_size
        if not blocks:
            return
        for row, keys in enumerate(layout.keys):
            cache.share(row, self._pool.lookup(keys[:blocks]))
        cache.advance(layout.start)

    def _register_prefix(self, cache: KVCache, layout: _Layout, live: int) -> None:
        """Offer the prefilled rows' full prompt blocks to later prompts (not the warm-up's)."""
        if not self.prefix_caching or self._warming:
            return
        for row, (keys, blocks) in enumerate(zip(layout.keys, layout.aligned)):
            for block in range(layout.start // self.page_size, blocks):
                self._pool.register(keys[block], cache.tables[row, block])
        self._count_blocks()

    def _place(self, joining: list[Request], ids: np.ndarray, source: KVCache, logits: np.ndarray) -> None:
        """Move the prefilled prompts' keys and values (``source``) into free rows of the running batch, ending at
        its current column (left padding before them): the live rows lose no work."""
        width = ids.shape[1]
        free = sum(1 for r in self._rows if r is None or r.finished)
        position = self._state[0].position
        if max(width, position) >= self._column_limit() and self._compact_tables():
            position = self._state[0].position
        if max(width, position) >= self._column_limit() or free < len(joining) \
                or (source.paged and width > position and not self._shift_tables(width)):
            if source.paged:
                source.reset()  # its blocks back first: the rebuild prefills the prompts again
            self._rebuild(joining)  # the batch ran on (or was packed) while they prefilled: no room left
            return
        if width > self._state[0].position:
            self._move(width - self._state[0].position, width + CACHE_GROWTH)
        cache, capture, tokens, mask, length = self._state
        free = [row for row, r in enumerate(self._rows) if r is None or r.finished]
        end = cache.position
        for index, (request, row) in enumerate(zip(joining, free)):
            cache.place_row(source, index, row)
            tokens[row] = self.pad
            tokens[row, end - width:] = ids[index]
            mask[row] = cache.mask[row, :end]
            self._rows[row] = request
        lazy.realize([])  # the copies, before the next step's graph
        if source.paged:
            source.reset()  # its blocks back to the pool
        self.metrics.placements += 1
        self.metrics.live_rows = sum(1 for r in self._rows if r is not None and not r.finished)
        self._choose(logits, list(enumerate(joining)))
        self._free_rows()

    def _step(self) -> None:
        """One decode step of every row: each row's last token in, the next token chosen."""
        if self._state[0].position + 1 > self._state[0].max_len:
            if self._state[0].max_len < self._column_limit():
                self._move(0, 2 * self._state[0].max_len)  # double the cache
            elif not self._compact_tables():
                self._rebuild([])  # packs the batch; its prefill chooses this step's tokens
                return
        if self._state[0].paged and not self._reserve_step():
            return
        cache, capture, tokens, mask, length = self._state
        last = np.array([r.generated[-1] if r is not None else self.pad for r in self._rows], np.int64)
        tokens = np.concatenate([tokens, last[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(self._rows), 1), mask.dtype)], axis=1)
        step_ids = last[:, None].astype(np.int32)
        step_positions = self.model.generation_positions(mask, tokens, length)[:, -1:].astype(np.int32)
        replays, began = capture.replays, time.perf_counter()
        logits = chosen = None
        with self._selecting(self._rows, len(self._rows)):
            if capture.ready and self._replays() and self._greedy_only():  # the GPU chooses: no logits read back
                chosen = capture.choose(step_ids, step_positions)
            if chosen is None:
                logits = self.model.decode_step(capture, cache, step_ids, step_positions, mask,
                                                replay=self._replays())
        self.metrics.decode_seconds += time.perf_counter() - began
        self.metrics.replayed_steps += capture.replays - replays
        self._state = (cache, capture, tokens, mask, length)
        live = sum(1 for r in self._rows if r is not None and not r.finished)
        self.metrics.steps += 1
        self.metrics.live_rows = live
        self.metrics.peak_live_rows = max(self.metrics.peak_live_rows, live)
        self.metrics.occupancy_sum += live / len(self._rows)
        self._choose(logits, [(row, r) for row, r in enumerate(self._rows) if r is not None], chosen)
        self._free_rows()

    def _selecting(self, requests: list[Request | None], rows: int):
        """A context whose forwards run each of ``rows`` rows with its request's adapter (filler rows, and those
        past the requests: the base model), or nothing to do without adapters. The choices go into a persistent
        tensor per batch size, written only when they change: recorded plans of that size read it as they replay."""
        if self.adapters is None:
            return contextlib.nullcontext()
        chosen = [r.adapter if r is not None else 0 for r in requests] + [0] * (rows - len(requests))
        scales = self.adapters.row_scales(chosen)
        held = self._adapter_scales.get(rows)
        if held is None:
            device = self._device() or get_device()
            tensor = Tensor._from_lazy(lazy.persistent_buffer(scales, dt.float32, device, "adapter scales"))
            held = self._adapter_scales[rows] = (tensor, scales)
        elif not np.array_equal(held[1], scales):
            held[0].lazy.base.buffer.write(scales)
            held = self._adapter_scales[rows] = (held[0], scales)
        return self.adapters.selecting(held[0])

    def _moves_tables(self) -> bool:
        """Whether the running batch's columns may move by whole blocks of its block tables (a paged cache, and a
        model whose attention and positions count tokens, not columns): no copy, no prefill again."""
        return self._state is not None and self._state[0].paged and not self._column_bound

    def _shift_tables(self, width: int) -> bool:
        """Paged: make room for a prompt of ``width`` columns, longer than the batch's columns so far, by moving
        every row right by whole blocks (PagedKVCache.shift_right; first giving back the columns every row has to
        spare, when the move would not fit otherwise); False when it cannot (then the batch is rebuilt)."""
        if not self._moves_tables():
            return False
        blocks = lambda: -(-(width - self._state[0].position) // self.page_size)  # noqa: E731
        moved = self._state[0].shift_right(blocks())
        if moved is None and self._compact_tables():
            moved = self._state[0].shift_right(blocks())
        if moved is None:
            return False
        self._remap_columns(moved)
        self.metrics.shifts += 1
        return True

    def _compact_tables(self) -> bool:
        """Paged: give back the columns every row has to spare, by whole blocks (PagedKVCache.compact), instead of
        prefilling the whole batch again; False when none can go."""
        moved = self._state[0].compact() if self._moves_tables() else None
        if moved is None:
            return False
        self._remap_columns(moved)
        self.metrics.compactions += 1
        return True

    def _remap_columns(self, moved: np.ndarray) -> None:
        """The batch's host tokens and mask after its cache's columns moved (``moved``: the old column of each new
        one per row, -1 where the new one is padding)."""
        cache, capture, tokens, mask, length = self._state
        rows, old = np.arange(len(tokens))[:, None], np.maximum(moved, 0)
        shift = moved.shape[1] - tokens.shape[1]  # columns gained (or given back)
        tokens = np.where(moved >= 0, tokens[rows, old], self.pad)
        mask = np.where(moved >= 0, mask[rows, old], 0).astype(mask.dtype)
        self._state = (cache, capture, tokens, mask, max(0, length + shift))
        self.metrics.cache_tokens = len(tokens) * cache.max_len

    def _greedy_only(self) -> bool:
        """Whether every live row takes the most likely token as it is (no sampling, penalty, bias, grammar or
        logprobs)."""
        return all(r.params.temperature == 0 and not r.params.adjusts_logits and r.params.logprobs is None
                   for r in self._rows if r is not None and not r.finished)

    def _replays(self) -> bool:
        """Whether the model's forwards may be replayed from a recorded plan: its step depends on nothing outside
        its inputs and the cache (capture_decode), or so too once recurrent states live in persistent buffers, as
        the scheduler's caches keep them."""
        return bool(getattr(self.model, "capture_decode", True)) or (
            self._recurrent and bool(getattr(self.model, "capture_decode_with_row_states", False)))

    def _reserve_step(self) -> bool:
        """Paged: the blocks of the next decode step, preempting the newest requests while there are none (each
        queued first again; recomputed when it rejoins). False when no request is left to step."""
        cache = self._state[0]
        self._free_rows()
        while True:
            try:
                cache.reserve(cache.position + 1)
                return True
            except KVBlocksExhausted:
                live = [(r.arrived, row) for row, r in enumerate(self._rows) if r is not None and not r.finished]
                if len(live) <= 1:
                    raise  # one request alone outgrew the pool (submit's check leaves room: not expected)
                row = max(live)[1]
                request, self._rows[row] = self._rows[row], None
                cache.release_rows([row])
                self._requeue([request])
                self.metrics.preemptions += 1
                self.metrics.live_rows = len(live) - 1

    def _move(self, shift: int, columns: int) -> None:
        """Copy the running batch into a new cache of at least ``columns`` columns, every row's tokens ``shift``
        columns further right (the columns before them masked): to grow the cache, or to make room on the left for
        a prompt longer than the batch's columns so far."""
        old, _, tokens, mask, length = self._state
        rows = old.batch
        self._caches.pop(rows, None)
        self._forget_prefills(old)
        cache, capture = self._cache(rows, max(columns, old.position + shift))
        cache.advance(old.position + shift)
        cache.place_row(old, 0, 0, rows=rows)
        lazy.realize([])
        if old.paged:
            old.reset()  # its blocks back to the pool
        if shift:
            tokens = np.concatenate([np.full((rows, shift), self.pad, tokens.dtype), tokens], axis=1)
            mask = np.concatenate([np.zeros((rows, shift), mask.dtype), mask], axis=1)
            self.metrics.shifts += 1
        else:
            self.metrics.growths += 1
        self._state = (cache, capture, tokens, mask, length + shift)
        self.metrics.cache_tokens = rows * cache.max_len


class _IncrementalText:
    """A request's tokens decoded as they come: the new tokens with the few before them instead of the whole output
    each step (which costs a decode of every token so far per token). Decoding a suffix alone may differ at its
    start (a tokenizer drops a leading space there), so the new text is what the suffix adds to the tokens before
    it; it grows only once the new tokens make whole characters (no U+FFFD at its end)."""

    def __init__(self):
        self.text = ""
        self.prefix = 0  # tokens before this one are rendered into text, and the context starts here
        self.read = 0    # tokens before this one are rendered

    def extend(self, tokenizer, tokens: list[int]) -> str:
        """The text of ``tokens`` (the tokens given before, and new ones after them)."""
        if len(tokens) <= self.read:
            return self.text
        before = tokenizer.decode(tokens[self.prefix:self.read], skip_special_tokens=True)
        after = tokenizer.decode(tokens[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(tokens)
        return self.text


class _ProbeCache(KVCache):
    """A KVCache that notes whether any layer's attention depends on column distances (a sliding window, ALiBi)."""

    def __init__(self, *args, **kwargs):
        self.column_bound = False  # before KVCache's fields are counted as its own
        super().__init__(*args, **kwargs)

    def attend(self, layer, q, k, v, **options):
        self.column_bound |= bool(options.get("window")) or options.get("alibi_slopes") is not None
        return super().attend(layer, q, k, v, **options)


def _adjusted(scores: np.ndarray, request: Request) -> np.ndarray:
    """A row's logits [1, vocab] after the request's logit bias, allowed tokens, end tokens' mask (min_tokens) and
    penalties, in vLLM's order (SamplingParams)."""
    params, scores = request.params, scores.astype(np.float32, copy=True)
    for token, bias in params.logit_bias:
        scores[0, token] += bias
    if params.allowed_token_ids:
        allowed = np.asarray(params.allowed_token_ids, np.int64)
        kept = scores[0, allowed]
        scores[0] = -np.inf
        scores[0, allowed] = kept
    if len(request.generated) < params.min_tokens and request.eos:
        scores[0, [t for t in request.eos if t < scores.shape[1]]] = -np.inf
    if params.repetition_penalty != 1:
        seen = np.union1d(request.prompt_tokens, np.fromiter(request.counts, np.int64, len(request.counts)))
        seen = seen[seen < scores.shape[1]]
        values = scores[0, seen]
        scores[0, seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if request.counts and (params.presence_penalty or params.frequency_penalty):
        tokens = np.fromiter(request.counts, np.int64, len(request.counts))
        counts = np.fromiter(request.counts.values(), np.float32, len(request.counts))
        scores[0, tokens] -= params.frequency_penalty * counts + params.presence_penalty
    return scores


def _prompt_logprobs(logits: np.ndarray, targets: np.ndarray, top: int) -> list[TokenLogprob]:
    """Each row of ``logits`` [n, vocab] as the log-probability (log-softmax in float64) of its ``targets`` token,
    that token's rank, and the ``top`` most likely tokens (most likely first, ties by token id); HOST_LOGPROBS
    values at a time."""
    entries = []
    top, step = min(top, logits.shape[-1]), max(HOST_LOGPROBS // logits.shape[-1], 1)
    for first in range(0, len(logits), step):
        scores = logits[first:first + step].astype(np.float64)
        scores -= scores.max(axis=-1, keepdims=True)
        scores -= np.log(np.exp(scores).sum(axis=-1, keepdims=True))
        tokens = targets[first:first + len(scores)]
        chosen = scores[np.arange(len(scores)), tokens]
        ranks = (scores >= chosen[:, None]).sum(axis=-1)
        best = np.argpartition(-scores, top - 1, axis=-1)[:, :top] if top else np.zeros((len(scores), 0), np.int64)
        values = np.take_along_axis(scores, best, axis=-1)
        order = np.lexsort((best, -values), axis=-1)
        best, values = np.take_along_axis(best, order, axis=-1), np.take_along_axis(values, order, axis=-1)
        entries += [TokenLogprob(int(token), float(logprob), list(zip(map(int, ids), map(float, lps))), int(rank))
                    for token, logprob, ids, lps, rank in zip(tokens, chosen, best, values, ranks)]
    return entries


def _logprob(scores: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under the model's distribution (before temperature and top-p), and the
    ``top`` most likely tokens'."""
    logprobs = np.log(np.maximum(_softmax(scores[None])[0], 1e-300))
    best = np.argsort(-logprobs, kind="stable")[:top] if top else []
    return TokenLogprob(token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in best])
