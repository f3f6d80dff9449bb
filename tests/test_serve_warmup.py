"""``BatchScheduler.warm_up`` and ``vkformers serve``'s warm-up: synthetic requests run before the server starts, so
that the first real requests replay their prefills and decode steps instead of building and recording them in
Python. On lavapipe with a GPU's prompt layout (prompts laid out at powers of two from 16 columns up to a
PREFILL_CHUNK of 32, as a GPU lays them out from 64 up to 512): after the warm-up, a request alone, a batch of two
and a request joining it replay (counted by the metrics), their outputs are those of ``model.generate`` alone and of
the same requests without a warm-up, and the warm-up leaves no KV block held, no prefix registered and the metrics
as they were."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_serve import (PROMPTS, encode, prefill_bucket, reference_tokens, run_staggered, scheduler_on, wait_for,
                        write_tiny_model)
from test_serve_recurrent import alone, char_tokenizer, load

from vkformers.cli import build_parser
from vkformers.cli import serve as cli_serve
from vkformers.models import batching
from vkformers.models.batching import BatchScheduler, Metrics, Request, SamplingParams, WarmupError
from vkformers.models.paged_cache import SCRATCH
from vkformers.runtime.vulkan import get_device

try:  # the [serve] extra (CI installs it)
    import uvicorn
except ImportError:
    uvicorn = None

SIZES, WIDTHS = (1, 2), (16, 32, 64)  # 64 columns: two chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("warmup"))


@pytest.fixture
def gpu_layout(monkeypatch):
    """Prompts laid out as on a GPU (a multiple of PREFILL_BUCKET, then a power of two up to PREFILL_CHUNK), smaller."""
    prefill_bucket(monkeypatch, 16)
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 32)


def paged_options(paged):
    # blocks of 4 tokens: the warm-up's prompts of 17 tokens fill blocks that prefix caching would register
    return {"kv_blocks": 96, "page_size": 4} if paged else {}


def serve_first_requests(scheduler, tokenizer):
    """What the first requests of a server meet: one alone (a rebuild of one row), then two arriving together (a
    rebuild of two rows) and, once the short one of them finished, a third joining their batch (prefilled apart and
    placed into the free row). Returns the requests."""
    tokens = encode(tokenizer, " ".join(PROMPTS))
    first = Request(tokens[-40:], SamplingParams(max_tokens=5, temperature=0), lambda update: None, [])
    # the long one's updates pace its steps, so that it still runs when the third joins
    long = Request(tokens[:20], SamplingParams(max_tokens=30, temperature=0), lambda update: time.sleep(0.02), [])
    short = Request(tokens[-6:], SamplingParams(max_tokens=1, temperature=0), lambda update: None, [])
    joining = Request(tokens[-13:], SamplingParams(max_tokens=4, temperature=0), lambda update: None, [])
    scheduler.start()
    try:
        scheduler.submit(first)
        wait_for(lambda: first.finished)
        with scheduler._cond:  # admitted at one turn: one batch of two rows
            scheduler.submit(long)
            scheduler.submit(short)
        wait_for(lambda: short.finished)
        scheduler.submit(joining)
        wait_for(lambda: long.finished and joining.finished)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.last_error is None
    return [first, long, short, joining]


def check_empty(scheduler):
    """No request's trace: no KV block held or registered, and every metric as a new scheduler's."""
    assert scheduler.metrics == Metrics(kv_blocks=scheduler.metrics.kv_blocks)
    pool = scheduler._pool
    if pool is not None:
        assert pool.used_blocks == 0 and pool.cached_blocks == 0 and not pool.refs.any()
        assert pool.free_blocks == pool.blocks - 1 and SCRATCH not in pool._free
    assert scheduler._state is None and not scheduler._rows and not scheduler._waiting


def greedy_alone(scheduler, ids, tokens: int) -> Request:
    """One greedy request of ``tokens`` tokens through ``scheduler`` (started here, closed after), finished."""
    scheduler.start()
    try:
        request = scheduler.submit(Request(ids, SamplingParams(max_tokens=tokens, temperature=0), lambda u: None, []))
        wait_for(lambda: request.finished)
    finally:
        scheduler.close()
    return request


@pytest.mark.parametrize("paged", [False, True])
def test_after_the_warm_up_the_first_requests_replay_and_answer_as_without_it(tiny, paged, gpu_layout):
    path, tokenizer, reference = tiny
    outputs, metrics = {}, {}
    for warm in (True, False):
        scheduler = scheduler_on(path, tokenizer, max_batch=4, max_model_len=96, **paged_options(paged))
        if warm:
            report = scheduler.warm_up(SIZES, WIDTHS)
            assert (report.batch_sizes, report.prompt_widths) == (SIZES, WIDTHS) and not report.skipped
            # each chunk of each width alone and joining a batch, every plan held (left-padded, the 64-column
            # prompt's first chunk is the 32-column prompt's shape: six); a decode step per batch size
            plans = 8 if paged else 6
            assert (report.prefill_plans, report.prefill_shapes) == (plans, plans)
            assert all(capture.ready for capture, _ in scheduler._prefill_captures.values())  # the others dropped
            assert all(scheduler._caches[rows][1].ready for rows in SIZES)
            assert report.summary().startswith(f"warm-up: decode steps of 1, 2 rows; prefills of prompts of 16, 32, "
                                               f"64 columns, alone and joining a batch ({plans} of {plans} plans "
                                               "held) in ")
            check_empty(scheduler)
        requests = serve_first_requests(scheduler, tokenizer)
        outputs[warm] = [r.generated for r in requests]
        metrics[warm] = scheduler.metrics
    expected = [reference_tokens(reference, r.prompt, r.params.max_tokens).tolist() for r in requests]
    assert outputs[True] == outputs[False] == expected
    warm = metrics[True]
    assert (warm.rebuilds, warm.placements, warm.prefills) == (2, 1, 4)
    # the request alone (its two chunks) and the one joining replay their prefill (the batch of two rows was not
    # warmed up); every decode step replays, from the first on
    assert warm.prefill_replays == 3 and warm.replayed_steps == warm.steps > 0
    assert warm.prefix_hit_tokens == 0  # (the warm-up's prompts registered no block)
    cold = metrics[False]
    assert (cold.prefills, cold.prefill_replays) == (4, 0) and cold.replayed_steps < cold.steps


def test_the_warm_up_gives_back_every_block_and_registers_no_prefix(tiny, gpu_layout):
    """With prefix caching on, the warm-up's prompts would register their full blocks: none is, and a later prompt
    of the same tokens finds nothing cached; every block comes back and the metrics count no warm-up request."""
    path, tokenizer, reference = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=4, max_model_len=96, **paged_options(True))
    assert scheduler.prefix_caching
    report = scheduler.warm_up((1, 2, 4), WIDTHS)
    assert report.batch_sizes == (1, 2, 4) and report.prefill_plans == 8
    check_empty(scheduler)
    same = [scheduler.pad] * 17  # the warm-up's prompt of the 32 columns
    request = greedy_alone(scheduler, same, 3)
    assert scheduler.metrics.prefix_hit_tokens == 0 and scheduler.metrics.prefill_replays == 1
    assert request.generated == reference_tokens(reference, same, 3).tolist()


def test_warm_up_shapes_are_checked_and_a_cpu_device_warms_up_nothing_by_default(tiny, gpu_layout, monkeypatch):
    path, tokenizer, _ = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=6, max_model_len=96)
    assert scheduler.batch_sizes() == (1, 2, 4, 6)
    device = scheduler._device
    scheduler._device = lambda: SimpleNamespace(is_cpu=True, memory=lambda: {"size": 1 << 40})  # as lavapipe
    assert scheduler.default_warmup() == ((), ())
    assert scheduler.warm_up() == batching.WarmupReport()
    # as a GPU: every batch size, widths up to 2 chunks
    scheduler._device = lambda: SimpleNamespace(is_cpu=False, memory=lambda: {"size": 1 << 40})
    assert scheduler.default_warmup() == ((1, 2, 4, 6), (16, 32, 64))
    # contiguous caches (this scheduler's) within a share of the device's memory, the smallest batches first
    row = batching.block_bytes(*scheduler._geometry, scheduler._columns(64 + batching.CACHE_GROWTH), scheduler._dtype())
    assert scheduler._affordable_batch_sizes((6, 1, 4, 2), (16, 32, 64), 3 * row) == (1, 2)
    monkeypatch.setattr(batching, "WARMUP_CONTIGUOUS_SHARE", 7 * row / (1 << 40))
    assert scheduler.default_warmup() == ((1, 2, 4), (16, 32, 64))
    monkeypatch.setattr(batching, "WARMUP_PREFILL_PLANS", 3)  # each width twice (alone, joining): one width fits
    assert scheduler.default_warmup()[1] == (16,)
    scheduler._device = device
    for sizes, widths, message in [((3,), (), "warm-up batch size 3: the scheduler runs batches of 1, 2, 4, 6 rows"),
                                   ((), (24,), "warm-up prompt width 24: prompts of up to max_model_len 96 tokens are "
                                               "laid out at 16, 32, 64, 96 columns"),
                                   ((), (16, 32, 64), "8 prefill plans .* more than a warm-up holds "
                                                      r"\(WARMUP_PREFILL_PLANS 3\)"),
                                   (("2",), (), "warm-up batch sizes must be whole numbers, got '2'"),
                                   ((2.5,), (), "warm-up batch sizes must be whole numbers, got 2.5"),
                                   (2, (), "warm-up batch sizes must be whole numbers, got 2"),
                                   ((), (True,), "warm-up prompt widths must be whole numbers, got True")]:
        with pytest.raises(WarmupError, match=message):
            scheduler.warm_up(sizes, widths)
    scheduler.start()
    try:
        with pytest.raises(WarmupError, match=r"warm_up\(\) runs before start\(\)"):
            scheduler.warm_up((1,), ())
    finally:
        scheduler.close()


def test_the_warmed_up_prefills_stay_while_other_shapes_come_and_go(tiny, monkeypatch):
    """PREFILL_PLANS 2: the warm-up's two prefill shapes (16 columns alone and joining) are held beside the two that
    live traffic's prompts of other widths take in turn, so a prompt of 16 columns still replays after them."""
    prefill_bucket(monkeypatch, 16)
    monkeypatch.setattr(batching, "PREFILL_POWERS_OF_TWO", False)  # widths of whole buckets, one chunk each
    monkeypatch.setattr(batching, "PREFILL_PLANS", 2)
    path, tokenizer, reference = tiny
    tokens = encode(tokenizer, " ".join(PROMPTS))
    prompts = [tokens[:n] for n in (20, 40, 70, 12)]  # 32, 48 and 80 columns, then 16
    scheduler = scheduler_on(path, tokenizer, max_batch=2, max_model_len=96)
    assert scheduler.warm_up((), (16,)).prefill_plans == 2
    scheduler.start()
    try:
        outputs = [run_staggered(scheduler, [(ids, SamplingParams(max_tokens=2, temperature=0))])[0].generated
                   for ids in prompts]
        assert len(scheduler._prefill_captures) == 4 and len(scheduler._warmed_prefills) == 2
    finally:
        scheduler.close()
    assert outputs == [reference_tokens(reference, ids, 2).tolist() for ids in prompts]
    assert scheduler.metrics.prefills == 4 and scheduler.metrics.prefill_replays == 1


def test_batches_of_one_row_warm_up_prompts_alone(tiny, gpu_layout):
    """max_batch 1: no batch ever has a row to spare, so prompts are only prefilled alone."""
    path, tokenizer, _ = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=1, max_model_len=96)
    report = scheduler.warm_up((1,), WIDTHS)
    assert (report.joining, report.prefill_plans, report.prefill_shapes) == (False, 3, 3)
    assert "prefills of prompts of 16, 32, 64 columns, alone (3 of 3 plans held)" in report.summary()
    check_empty(scheduler)


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_a_recurrent_model_warms_up_its_decode_steps(name):
    """Layers of recurrent state keep it in buffers overwritten in place: the warm-up's decode steps are those of the
    first request, which replays every step; its prefills replay only per prompt (the key holds the mask), so no
    prompt width is warmed up."""
    tokenizer = char_tokenizer()
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=2, max_model_len=64)
    with pytest.raises(WarmupError, match="replay only for prompts of one length"):
        scheduler.warm_up((), (16,))
    assert scheduler.warm_up((1, 2), ()).batch_sizes == (1, 2)
    check_empty(scheduler)
    request = greedy_alone(scheduler, ids, 6)
    assert request.generated == alone(load(name), ids, 6)
    assert scheduler.metrics.replayed_steps == scheduler.metrics.steps == 5


class FakeUvicorn:
    """uvicorn's Server and Config, serving nothing: serve() returns once the scheduler started."""

    class Config:
        def __init__(self, app, **options):
            self.app = app

    class Server:
        def __init__(self, config):
            self.started = False

        def run(self, sockets):
            self.started = True


@pytest.mark.parametrize("options", [["--warmup-batch-sizes", "1,2", "--warmup-prompt-widths", "16"],
                                     ["--no-warmup", "--warmup-batch-sizes", "1,2"], []])
def test_the_command_warms_up_before_it_says_where_it_serves(tiny, gpu_layout, monkeypatch, capsys, options):
    """The warm-up line comes before the URL's (the server listens after it); --no-warmup skips it, and so does a
    CPU device by default."""
    if uvicorn is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve]'", pytrace=False)
    path, _, _ = tiny
    started = []
    start = BatchScheduler.start
    monkeypatch.setattr(BatchScheduler, "start", lambda self: started.append(self.metrics.requests) or start(self))
    args = build_parser().parse_args(["serve", "--model", str(path), "--max-batch", "2", "--max-model-len", "64",
                                      "--kv-cache-tokens", "512", *options])
    assert cli_serve.serve(args, FakeUvicorn, None) == 0
    lines = capsys.readouterr().err.splitlines()
    url = f"vkformers serve: {path.stem} on http://127.0.0.1:8000/v1 (ready when /health answers)"
    if options and options[0] != "--no-warmup":
        assert lines[0].startswith("vkformers serve: warm-up: decode steps of 1, 2 rows; prefills of prompts of 16 "
                                   "columns, alone and joining a batch (2 of 2 plans held) in ")
        lines = lines[1:]
    elif not options and not get_device().is_cpu:  # a GPU warms up by default
        assert lines[0].startswith("vkformers serve: warm-up: ")
        lines = lines[1:]
    assert lines[0] == url and lines[1].startswith("vkformers serve: paged KV cache: ")
    assert started == [0]  # started once, the warm-up's requests not counted


def test_warm_up_arguments():
    parse = build_parser().parse_args
    defaults = parse(["serve"])
    assert defaults.warmup and defaults.warmup_batch_sizes is None and defaults.warmup_prompt_widths is None
    args = parse(["serve", "--no-warmup", "--warmup-batch-sizes", "1,2,4", "--warmup-prompt-widths", "none"])
    assert (args.warmup, args.warmup_batch_sizes, args.warmup_prompt_widths) == (False, (1, 2, 4), ())
    for wrong in ("0", "1,,2", "two"):
        with pytest.raises(SystemExit):
            parse(["serve", "--warmup-batch-sizes", wrong])
    assert parse(["serve", "--warmup-prompt-widths", "64,512"]).warmup_prompt_widths == (64, 512)
