"""Type stubs for recsys (the extension module recsys._recsys)."""

from os import PathLike
from typing import Any, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

__version__: str

ItemId = Union[int, str]
#: A 1-D array of int64 ids (a history, candidates), or a 2-D one (one history per row).
IdArray = npt.NDArray[np.int64]
#: One history (or exclusion or candidate list): ids in a sequence or a numpy array.
History = Union[Sequence[ItemId], IdArray]
#: One per user: a sequence of histories, or a 2-D int64 array with a history per row.
Histories = Union[Sequence[History], IdArray]
Ids = Union[npt.NDArray[np.int64], list[list[str]]]
#: Item set names ("category=shoes"): one list for every history, or one list per history.
SetNames = Union[Sequence[str], Sequence[Sequence[str]]]
#: One list of unix timestamps (seconds) per history, one per id: for the models that read time
#: (HSTU); other models ignore them.
Timestamps = Union[Sequence[Sequence[int]], npt.NDArray[np.int64]]
#: When the event to predict happens: one time for every history, or one per history.
QueryTimestamp = Union[int, Sequence[int]]

class RecsysError(Exception):
    """An engine, checkpoint or file that recsys cannot use; the message says why."""

class Engine:
    """A loaded engine directory (written by `recsys convert`).

    >>> engine = recsys.Engine(path, threads=1)   # path: an engine directory, e.g. model_repository/sasrec/1
    >>> engine.kind, engine.num_items, engine.embedding_dim
    ('sasrec', 2000, 65)
    """

    def __init__(self, path: Union[str, PathLike[str]], threads: int | None = None, device: str = "cpu",
                 prefix_cache_bytes: int = 0, screen_policy: str = "auto", bf16_path: str = "auto",
                 amx: str = "auto", row_block: str = "auto", thread_plan: str = "auto") -> None:
        """Loads and verifies the engine; `threads` scoring threads per call, 1 to 1024 (default:
        the cores).
        `prefix_cache_bytes` > 0 (GRU4Rec, SASRec): keep the model's state after recent histories
        within that many bytes, so a history one event longer computes one event; answers never
        change (BERT4Rec and Mult-VAE refuse it, naming why).
        `screen_policy` (screened engines): "auto" runs the int8 screen at the batch sizes where it
        measured faster on this CPU (the plan is kept for the next load), "always" or "never".
        `bf16_path` (bf16 engines on CPUs with AVX512-BF16): "auto" runs `vdpbf16ps` or bf16
        widened to f32 per batch size, whichever measured faster here (kept like the screen's
        plan), "native"
        or "widened"; the answers are the same.
        `amx` (bf16, int8 and screened engines on CPUs with AMX, Xeons since Sapphire Rapids):
        "auto" runs a bf16 engine's layers, an int8 or W8A8 engine's output layer, or a screened
        engine's int8 screen, on AMX tiles at the batch sizes where they measured faster here (kept
        like the screen's plan), "on" or "off"; bf16 tiles add in another order, so scores may
        differ in the last bits, while int8 and screened engines' answers keep their bits. Without AMX the SIMD kernels run and `kernel_plan` says why.
        `row_block` (AVX-512 kernels): "auto" cuts batches into row groups of up to 8 rows or of
        up to 4, whichever measured faster here (kept like the screen's plan), "4" or "8"; the
        answers are the same.
        `thread_plan` (engines of more than one thread): "auto" gives each batch size the fewest
        threads within 5 % of its fastest on this CPU (kept like the screen's plan), "all", or a
        count ("1", "2" ...); the answers are the same.
        `path`: an engine directory, or its folder in object storage (s3://..., gs://..., as the
        command line takes them, with the same credentials), fetched into TMPDIR first.
        `device`: "cpu", or "cuda" / "cuda:N" in a package built with CUDA support
        (`scripts/build-wheel.sh --cuda 12|13`): the whole model on that GPU, checked against
        the CPU engine at load (`score` stays on the CPU); a CPU-only package refuses it."""
    @property
    def device(self) -> str:
        """Where batches run: "cpu" or "cuda:N"."""
    @property
    def info(self) -> dict[str, Any]:
        """The engine's metadata as a plain dict: kind, precision, num_items, id_type,
        embedding_dim, threads, device, path, weights_sha256, catalogue_version,
        availability_version, and manifest (the whole manifest: source checkpoint, quantization,
        calibration, screen, item attributes, popularity, a folded catalogue, created_at/by).

        >>> engine.info["kind"], engine.info["num_items"]
        ('sasrec', 2000)
        """
    @property
    def kind(self) -> str:
        """"bert4rec", "vaecf", "sasrec" or "gru4rec"."""
    @property
    def precision(self) -> str:
        """"fp32", "fp16" or "int8"."""
    @property
    def num_items(self) -> int:
        """Items in the catalogue (N)."""
    @property
    def threads(self) -> int: ...
    @property
    def embedding_dim(self) -> int:
        """The model's hidden size plus 1: the width of `embed`'s rows."""
    @property
    def item_ids(self) -> Union[npt.NDArray[np.int64], list[str]]:
        """External ids of items 1..=N: the columns of `score`, the rows of `recsys export-items`.

        >>> engine.item_ids[:3].tolist()
        [10006762, 10006545, 10006853]
        """
    @property
    def item_sets(self) -> dict[str, int]:
        """The item set names requests may filter by ("column=value", from the item attributes
        the engine was converted with, and from the availability object in force), each with its
        item count.

        >>> sorted(engine.item_sets)[:2]
        ['age_rating=adult', 'age_rating=all']
        """
    def load_availability(self, source: str) -> int:
        """Puts a live availability object in force (a file, or s3://... / gs://...; written by
        `recsys availability publish`): its sets join `item_sets`. Refused (RecsysError) when it is
        damaged or not newer than the one in force. Returns its version."""
    def load_catalogue(self, source: str) -> int:
        """Puts a live catalogue delta in force (a file, or s3://... / gs://...; written by
        `recsys catalogue publish` for this engine): added items can be recommended, retired ones
        never are. Refused (RecsysError) when it is damaged, made for another engine or a row
        cannot apply. Returns its version."""
    @property
    def catalogue_version(self) -> int | None:
        """The version of the catalogue delta in force (None: the catalogue as converted)."""
    @property
    def screen_plan(self) -> str | None:
        """A screened engine's plan per batch size and where it came from; None without a screen."""
    @property
    def kernel_plan(self) -> str | None:
        """A bf16 engine's kernels per batch size: on a CPU with AVX512-BF16 "vdpbf16ps" or
        widened; whether the bf16 layers run on AMX tiles ("AMX bf16 layers batch 64+: AMX
        tiles (...)"), or why not ("AMX tiles not used: this CPU has no AMX ..."); the times
        behind each choice and where it came from. None for other engines, and with amx="off" on
        CPUs without AVX512-BF16."""
    @property
    def row_block_plan(self) -> str | None:
        """The largest row group AVX-512 kernels cut a batch into ("row groups of up to 8 rows
        (...)"), the times behind it and where it came from; None for scalar and AVX2 kernels."""
    @property
    def thread_plan(self) -> str | None:
        """Threads per batch size ("batch 1+: 1 thread (...); batch 8+: 2 threads ..."), the times
        behind them and where the plan came from; None for an engine of one thread."""
    @property
    def prefix_cache_stats(self) -> dict[str, int] | None:
        """The prefix cache's counters (hits, misses, events_computed, events_reused, evictions,
        expirations, bytes, entries); None without a cache."""
    @property
    def availability_version(self) -> int | None:
        """The version of the availability object in force (None: none)."""
    def recommend(
        self,
        histories: Histories,
        k: int = 10,
        exclude: Histories | None = None,
        exclude_seen: bool = True,
        strict: bool = False,
        include_sets: SetNames | None = None,
        exclude_sets: SetNames | None = None,
        timestamps: Timestamps | None = None,
        query_timestamp: QueryTimestamp | None = None,
    ) -> tuple[Ids, npt.NDArray[np.float32]]:
        """Each history's best k items, best first: ids [B, k] (-1 padding; lists for string
        catalogues) and float32 scores [B, k] (-inf padding). `exclude`: one list per history of
        items never to return; `exclude_seen`: leave the history's own items out;
        `include_sets`: only items in every named column's sets (OR within a column, AND across
        columns); `exclude_sets`: no item of these sets; `timestamps` (one list of unix seconds per
        history, one per id) and `query_timestamp` (when the event to predict happens; default
        now): required by the models that read time (HSTU). Set names are one list for every history
        or one list per history; an unknown name raises ValueError naming it.

        >>> ids, scores = engine.recommend([[10011403, 10011207], [10011739]], k=3)
        >>> ids.tolist()
        [[10011739, 10011235, 10011788], [10011620, 10011788, 10011375]]
        >>> [round(float(s), 2) for s in scores[0]]
        [9.15, 8.66, 8.62]
        >>> engine.recommend([[10011403, 10011207]], k=3, include_sets=["category=shoes"])[0].tolist()
        [[10011739, 10011431, 10011480]]
        """
    def rerank(
        self,
        histories: Histories,
        candidates: Histories,
        k: int = 10,
        exclude: Histories | None = None,
        exclude_seen: bool = True,
        strict: bool = False,
        include_sets: SetNames | None = None,
        exclude_sets: SetNames | None = None,
        timestamps: Timestamps | None = None,
        query_timestamp: QueryTimestamp | None = None,
    ) -> tuple[Ids, npt.NDArray[np.float32]]:
        """The best k of each history's own candidates (narrowed by the set filters) (a retrieval stage's), with exactly the
        scores the whole-catalogue scan gives them; padded as `recommend`.

        >>> ids, scores = engine.rerank([[10011403, 10011207]], candidates=[[10011739, 10011445, 10002744]], k=2)
        >>> ids.tolist()
        [[10011739, 10011445]]
        """
    def embed(
        self,
        histories: Histories,
        strict: bool = False,
        timestamps: Timestamps | None = None,
        query_timestamp: QueryTimestamp | None = None,
    ) -> npt.NDArray[np.float32]:
        """User embeddings [B, embedding_dim] = [h, 1]: the inner product with an item's row of
        `recsys export-items` is the model's score for it.

        >>> engine.embed([[10011403, 10011207]]).shape
        (1, 65)
        """
    def score(
        self,
        histories: Histories,
        timestamps: Timestamps | None = None,
        query_timestamp: QueryTimestamp | None = None,
    ) -> npt.NDArray[np.float32]:
        """Every item's score [B, N] (column j is item_ids[j]), nothing left out: for evaluation.

        >>> engine.score([[10011403, 10011207]]).shape
        (1, 2000)
        """
    def predict(
        self,
        histories: Histories,
        k: Sequence[int | None] | None = None,
        exclude: Histories | None = None,
        candidates: Histories | None = None,
        default_k: int = 10,
        exclude_seen: bool = True,
        strict: bool = False,
        embedding: bool = False,
        include_sets: SetNames | None = None,
        exclude_sets: SetNames | None = None,
        timestamps: Timestamps | None = None,
        query_timestamp: QueryTimestamp | None = None,
    ) -> tuple[
        list[Union[npt.NDArray[np.int64], list[str]]],
        list[npt.NDArray[np.float32]],
        list[npt.NDArray[np.float32] | None],
        list[str | None],
    ]:
        """Per-history answers as `recsys predict` gives them, for batch jobs (recsys.ray uses it):
        `k` one value per history (None: `default_k`); a refused history gets its error message
        (and empty ids and scores) instead of failing the call. Returns (ids, scores, embeddings,
        errors), one entry per history, each answer its own length.

        >>> ids, scores, embeddings, errors = engine.predict([[10011403, 10011207], [-5]], k=[2, 2])
        >>> ids[0].tolist(), errors[0]
        ([10011739, 10011235], None)
        >>> errors[1].startswith("invalid request")
        True
        """
    def timelines(
        self,
        histories: Histories,
        k: int = 10,
        exclude_seen: bool = True,
        strict: bool = False,
        timestamps: Optional[Sequence[Sequence[int]]] = None,
        query_timestamp: Optional[Union[int, Sequence[int]]] = None,
    ) -> list[
        tuple[
            list[Union[npt.NDArray[np.int64], list[str]]],
            list[npt.NDArray[np.float32]],
            list[str | None],
        ]
    ]:
        """Each history's answers after each of its events (event t answers its first t ids as
        `predict` would), for replaying a log: one (ids, scores, errors) triple per history, each
        a list with an entry per event. With `prefix_cache_bytes` set (GRU4Rec, SASRec, HSTU)
        each step computes one event per history (HSTU two); without, every prefix is
        recomputed. For HSTU, `timestamps` gives each history's event times: each prefix is
        queried at its next event's time, the whole history at `query_timestamp` (default now).

        >>> cached = recsys.Engine(path, threads=1, prefix_cache_bytes=1 << 20)
        >>> (ids, scores, errors), = cached.timelines([[10011403, 10011207, 10011739]], k=2)
        >>> len(ids), ids[1].tolist(), ids[2].tolist()
        (3, [10011739, 10011235], [10011788, 10011620])
        """

def convert(
    kind: str,
    checkpoint: Union[str, PathLike[str]],
    item_map: Union[str, PathLike[str]],
    output: Union[str, PathLike[str]],
    config: Union[str, PathLike[str], None] = None,
    precision: str = "fp32",
    int8_mode: str = "weight-only",
    calibration: Union[str, PathLike[str], None] = None,
    calibration_method: str = "entropy",
    calibration_percentile: float = 99.99,
    screen: str = "none",
    force: bool = False,
    item_attributes: Union[str, PathLike[str], None] = None,
    interactions: Union[str, PathLike[str], None] = None,
    interactions_item_column: str | None = None,
) -> Engine:
    """`recsys convert`: a PyTorch or RecBole checkpoint (read without executing pickle code) into
    a verified engine directory at `output`; returns it loaded. `int8_mode`: "weight-only",
    "w8a8" (the output layer's input at a calibrated static int8 scale) or "w8a8-all" (every dense
    layer's too, as an explicit-quantization ONNX export computes); both W8A8 modes need
    `calibration`. `screen="int8"` (fp32 and fp16): each top k screened from int8 weights, the
    same answers bit for bit. `item_attributes`: a CSV or TSV table keyed by the external item id
    (list cells as `a|b`); every value of every column becomes an item set requests filter by.
    `interactions`: an interaction log (CSV, TSV or RecBole's .inter) whose item column is counted
    into the popularity list that answers histories without a known item.

    >>> engine = recsys.convert("sasrec", "tests/fixtures/sasrec/model.safetensors",
    ...                         "tests/fixtures/sasrec/item_id_map.tsv", f"{tmp}/sasrec-int8",
    ...                         config="tests/fixtures/sasrec/config.json", precision="int8")
    >>> engine.precision
    'int8'
    """

def evaluate(
    engine: Engine,
    test_set: Union[str, PathLike[str]],
    k: Sequence[int] = (10, 20, 100),
    batch_size: int = 256,
) -> dict[str, Any]:
    """`recsys eval`: NDCG/Recall@k and MRR over a test set (TSV: user, target, history), as a dict
    with "metrics", "unknown_history_ids" and "unknown_targets".

    >>> report = recsys.evaluate(engine, "tests/fixtures/test_set.tsv", k=[10])
    >>> sorted(report["metrics"]), report["metrics"]["n_users"]
    (['mrr', 'n_users', 'ndcg@10', 'recall@10'], 5000)
    """
