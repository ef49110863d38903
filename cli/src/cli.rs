//! Command-line definitions. The help text is the user manual of each command.

use std::path::PathBuf;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use recsys_engine::engine_dir::{Precision, Screen};
use recsys_engine::{CalibrationChoice, ConvertOptions, Int8Mode};

#[derive(Parser, Debug)]
#[command(
    name = "recsys",
    version,
    about = "Convert, evaluate and run BERT4Rec and VAE-CF recommenders",
    long_about = "recsys turns recommenders trained in PyTorch or RecBole into engine directories that the \
Triton backend (libtriton_recsys.so) serves, scores users offline, and evaluates ranking quality.\n\n\
Typical flow:\n  recsys convert --kind bert4rec --checkpoint model.pt --config config.json \\\n      \
--item-map item_id_map.tsv --output model_repository/bert4rec/1\n  \
recsys eval --engine model_repository/bert4rec/1 --test test_set.tsv\n  \
recsys predict --engine model_repository/bert4rec/1 --input users.jsonl --output recs.jsonl"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Import a trained checkpoint and write a verified engine directory.
    Convert(ConvertArgs),
    /// Score users offline: JSON lines of histories in, JSON lines of top-k items out.
    Predict(PredictArgs),
    /// Leave-one-out evaluation (NDCG@k, Recall@k, MRR) over the full catalogue.
    Eval(EvalArgs),
    /// Upload an engine to a Triton model repository (a directory, S3 or GCS) as the model's next
    /// version.
    Publish(PublishArgs),
    /// Approve a version after verifying it (every file's SHA-256, then a canary replica's
    /// self-check and quality gate): the newest approved version is the one every replica serves.
    Approve(StatusArgs),
    /// Reject a version; rejecting the serving version goes back to the previous approved one.
    Reject(StatusArgs),
    /// Serve an earlier approved version (the previous one, or --to): the newer approved versions
    /// are marked rolled back.
    Rollback(RollbackArgs),
    /// List a model's versions with their status, precision, metrics, creation time and the last
    /// gate failure; --prune --keep N removes old versions.
    Versions(VersionsArgs),
    /// Convert at every precision, measure quality against fp32 and latency, recommend one.
    Sweep(SweepArgs),
    /// Export an engine as an ONNX graph (fp32, fp16, int8 as explicit Q/DQ) for ONNX Runtime and
    /// TensorRT, optionally as a Triton onnxruntime model.
    ExportOnnx(ExportOnnxArgs),
    /// Export the item table ([embedding, bias] per item, with the external ids) for an ANN index.
    ExportItems(ExportItemsArgs),
    /// Live availability: item sets (in stock, available in a region) the servers of a model
    /// poll and swap in without a new version.
    #[command(subcommand)]
    Availability(AvailabilityCommand),
    /// Live catalogue: items added, replaced and retired since the engine was converted, which
    /// the servers of a model poll and swap in without a new version.
    #[command(subcommand)]
    Catalogue(CatalogueCommand),
    /// Print the shell completion script for bash, zsh, fish, elvish or PowerShell (source it,
    /// or save it where the shell loads completions: scripts/build-release.sh writes them to
    /// target/release/completions).
    Completions(CompletionsArgs),
    /// Write the manual pages (roff): recsys.1 and one page per command (recsys-convert.1, ...),
    /// into a folder (`man -l recsys.1` reads one; scripts/build-release.sh writes them to
    /// target/release/man).
    Man(ManArgs),
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub struct ManArgs {
    /// Folder to write the pages into (created if missing).
    #[arg(long, alias = "out")]
    pub output: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum CatalogueCommand {
    /// Publish a table of item rows as the model's catalogue delta, one version above the stored
    /// one, for the engine version its servers load; the delta is applied to that engine before
    /// anything is written. Every server naming it as `catalogue_source` swaps it in within one
    /// poll interval.
    Publish(CataloguePublishArgs),
    /// Show the catalogue object a repository holds for a model (or any source): version, age,
    /// the engine it is for, and its rows by kind.
    Show(CatalogueShowArgs),
    /// Fold the model's catalogue delta into a new engine version, published pending: verified
    /// to answer as the served engine with the delta before anything is written, then approved
    /// through the release path like any version. Servers of the new version take the current
    /// object as already folded in; the first delta published for it starts afresh.
    Compact(CatalogueCompactArgs),
    /// Estimate rows for items the engine lacks from their first interactions, with the model
    /// frozen, and write them as a catalogue table for `catalogue publish`.
    #[command(name = "fold-in")]
    FoldIn(CatalogueFoldInArgs),
}

const CATALOGUE_HELP: &str = "The table is Parquet in the schema `recsys export-items --format parquet \
--with-input-rows` writes: item_id (int64 or string, the engine's id type), vector ([embedding, bias]), \
optional input_vector (the item's input row: required for a new Mult-VAE item; the other models tie it \
to the embedding) and optional op (upsert, the default, or retire: never returned again, still read in \
histories). An upserted item the engine lacks is added; one it has gets its rows replaced. Each publish \
carries every change since the engine was converted: the object is the catalogue's whole state.\n\n\
The object is written to <repository>/<model>/recsys-catalogue.bin; the model's config.pbtxt names it \
for its servers:\n\n  \
parameters { key: \"catalogue_source\" value { string_value: \"s3://host:9000/models/shop/recsys-catalogue.bin\" } }\n  \
parameters { key: \"catalogue_poll_seconds\" value { string_value: \"30\" } }\n\n\
The repository is a local directory or object storage, in tritonserver's --model-repository syntax \
(s3://bucket/path, s3://host:port/bucket/path, gs://bucket/path).";

#[derive(Args, Debug)]
#[command(after_help = CATALOGUE_HELP)]
pub struct CataloguePublishArgs {
    /// The Triton model repository the model's servers load from.
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// The catalogue table (Parquet).
    #[arg(value_name = "TABLE")]
    pub table: PathBuf,
    /// The engine version the delta is for; default: the version the model's config serves (the
    /// newest its version policy names, else the newest folder).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub engine_version: Option<u64>,
    /// The catalogue version to publish (above the stored one); default: the stored version plus
    /// one.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub version: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(after_help = FOLD_IN_HELP)]
pub struct CatalogueFoldInArgs {
    /// The engine directory the rows are for.
    #[arg(long)]
    pub engine: PathBuf,
    /// The interaction log: RecBole's atomic .inter (tab-separated) or CSV, with a header naming
    /// user_id, item_id and optionally timestamp columns.
    #[arg(long, value_name = "FILE")]
    pub interactions: PathBuf,
    /// The catalogue table to write (Parquet).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// L2 penalty on each fitted row (and bias): larger keeps an item seen a few times nearer
    /// the catalogue's average score.
    #[arg(long, default_value_t = 1.0)]
    pub l2: f64,
    /// Interactions fitted per new item at most (its first ones).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_examples: u64,
    /// Contexts of the log sampled (evenly) to stand for all those in which a new item was not
    /// chosen: the part of the likelihood that keeps its scores down elsewhere.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub negative_samples: u64,
    /// Print JSON (a summary and a line per item) instead of text.
    #[arg(long)]
    pub json: bool,
}

const FOLD_IN_HELP: &str = "Every context of the log is the model's hidden vector for what a user had \
done (the known items before an event, in time order; for Mult-VAE the user's known items). A new \
item's output row and bias maximise the model's own softmax likelihood of the log with the rest of \
the model frozen, against the engine's whole catalogue: up where the item was chosen (its first \
--max-examples interactions), down everywhere else (estimated from --negative-samples contexts), \
with the L2 penalty. \
BERT4Rec, SASRec and GRU4Rec read an item's input row from the same row; Mult-VAE's input row is the \
mean input row of the known items its users also interacted with (co-occurrence). HSTU is refused.\n\n\
The table is a catalogue delta: publish it with `recsys catalogue publish` (merged with the other \
rows of the delta, which holds every change since the engine), or try it offline with \
`recsys predict --catalogue TABLE`.";

#[derive(Args, Debug)]
#[command(after_help = COMPACT_HELP)]
pub struct CatalogueCompactArgs {
    /// The Triton model repository the model's servers load from.
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// The engine version the stored delta is for; default: the version the model's config
    /// serves.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub engine_version: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

const COMPACT_HELP: &str = "When to compact: a delta costs no more per request than the same rows \
compiled into the engine, but every publish carries the whole delta to every replica, which rebuilds \
the item table each time it changes (about 0.4 s per 1e6 items, with twice the table's memory for \
that moment), and a retired item keeps its rows. Compact when the delta has grown to a sizeable share \
of the catalogue (a few percent), or before the publishes that follow would carry it again and again.\n\n\
The new version is pending: `recsys approve --repository R --model M --version N` puts it in \
service (with its canary and gates), `recsys reject` drops it. Until it serves, the servers of the \
old version go on applying the stored delta; once it serves, publish the changes made since to it.";

#[derive(Args, Debug)]
#[command(after_help = CATALOGUE_HELP)]
pub struct CatalogueShowArgs {
    /// The Triton model repository (with --model).
    #[arg(long, requires = "model", conflicts_with = "source")]
    pub repository: Option<String>,
    /// Model name (with --repository).
    #[arg(long, requires = "repository")]
    pub model: Option<String>,
    /// Any catalogue source as a server names it (a file, s3://..., gs://...).
    #[arg(long, required_unless_present = "repository")]
    pub source: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum AvailabilityCommand {
    /// Publish a table's sets as the model's availability, one version above the stored one:
    /// every server of the model that names it as `availability_source` takes it in within one
    /// poll interval.
    Publish(AvailabilityPublishArgs),
    /// Show the availability object a repository holds for a model (or any source): version, age,
    /// items and sets.
    Show(AvailabilityShowArgs),
}

const AVAILABILITY_HELP: &str = "The table has the same formats as convert --item-attributes: \
Parquet, CSV (.csv) or TSV, keyed by the external item id in its first column; every (column, value) \
becomes a set named column=value (stock=in, available_in=EU) that requests name in INCLUDE_ITEM_SETS \
and EXCLUDE_ITEM_SETS. A column of the availability hides the engine's attribute column of the same \
name. Ids the engine's catalogue does not hold are left out when a server takes the object in.\n\n\
The object is written to <repository>/<model>/recsys-availability.bin; the model's config.pbtxt names \
it for its servers:\n\n  \
parameters { key: \"availability_source\" value { string_value: \"s3://host:9000/models/shop/recsys-availability.bin\" } }\n  \
parameters { key: \"availability_poll_seconds\" value { string_value: \"10\" } }\n\n\
The repository is a local directory or object storage, in tritonserver's --model-repository syntax \
(s3://bucket/path, s3://host:port/bucket/path, gs://bucket/path).";

#[derive(Args, Debug)]
#[command(after_help = AVAILABILITY_HELP)]
pub struct AvailabilityPublishArgs {
    /// The Triton model repository the model's servers load from.
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// The availability table (Parquet, CSV or TSV; first column the external item id).
    #[arg(value_name = "FILE")]
    pub table: PathBuf,
    /// The version to publish (above the stored one); default: the stored version plus one.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub version: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(after_help = AVAILABILITY_HELP)]
pub struct AvailabilityShowArgs {
    /// The Triton model repository (with --model).
    #[arg(long, requires = "model", conflicts_with = "source")]
    pub repository: Option<String>,
    /// Model name (with --repository).
    #[arg(long, requires = "repository")]
    pub model: Option<String>,
    /// Any availability source as a server names it (a file, s3://..., gs://...).
    #[arg(long, required_unless_present = "repository")]
    pub source: Option<String>,
    /// List every set with its item count.
    #[arg(long)]
    pub sets: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The file formats of `recsys export-items`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemTableFormat {
    Npy,
    Parquet,
    Both,
}

#[derive(Args, Debug)]
#[command(
    after_help = "Writes FILE.npy, a NumPy float32 array [N, d + 1] (row r = item r + 1: its output \
embedding, then its bias), and FILE.ids.txt with the item's external id on line r + 1. For a user \
whose final hidden vector is h, [h, 1] . row is the model's score for that item (exactly, for fp32 \
and fp16 engines), so an inner-product index returns the model's ranking:\n\n  \
import numpy as np, faiss\n  items = np.load(\"items.npy\"); ids = open(\"items.ids.txt\").read().split()\n  \
index = faiss.IndexFlatIP(items.shape[1]); index.add(items)\n  \
scores, rows = index.search(np.append(h, 1.0)[None, :].astype(\"float32\"), 100)\n\n\
Leave the user's own history out of the hits afterwards, as the engine does.\n\n\
--format parquet writes FILE.parquet instead (snappy-compressed, row groups of at most 64 MiB): column \
item_id (int64, or string for string catalogues) and column vector, a fixed-size list of d + 1 float32 \
([embedding, bias], the same row), in the same order; Milvus, LanceDB, DuckDB, Spark and pandas read it \
as it is:\n\n  \
import pyarrow.parquet as pq, numpy as np\n  t = pq.read_table(\"items.parquet\")\n  \
items = np.stack(t[\"vector\"].to_numpy(zero_copy_only=False)); ids = t[\"item_id\"].to_pylist()"
)]
pub struct ExportItemsArgs {
    /// Engine directory written by `recsys convert`.
    #[arg(long)]
    pub engine: PathBuf,
    /// Where to write: FILE.npy and FILE.ids.txt (npy), FILE.parquet (parquet), or all three (both).
    #[arg(long, visible_alias = "out", value_name = "FILE")]
    pub output: PathBuf,
    /// npy: a NumPy array plus an ids file; parquet: one Parquet file with an item_id column and a
    /// vector column; both: all of them.
    #[arg(long, value_enum, default_value = "npy")]
    pub format: ItemTableFormat,
    /// Add each item's input row (the `input_vector` column of the Parquet table): what a history
    /// holding the item reads. Mult-VAE's differs from the vector; BERT4Rec, SASRec and GRU4Rec
    /// tie the two. With it, the table is a catalogue delta for any model kind
    /// (`recsys catalogue`).
    #[arg(long)]
    pub with_input_rows: bool,
    /// Replace existing files.
    #[arg(long)]
    pub force: bool,
    /// Print what was written as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(
    after_help = "The graph computes what the engine computes, at the engine's precision: fp32 weights as \
float; fp16 weights as FLOAT16 cast to float; int8 weights with the engine's per-row scales through \
DequantizeLinear, and for a W8A8 engine a QuantizeLinear/DequantizeLinear pair with the calibrated scale in \
front of the output layer (the explicit Q/DQ form TensorRT 10 builds int8 engines from). Opset 17.\n\n\
Inputs (int64, internal item indices; the engine's item_ids.tsv maps external ids):\n  \
BERT4Rec: item_seq [batch, L] = the last L-1 history items oldest first, then the MASK index N+1, \
right-padded with 0.\n  VAE-CF: items [batch, T] = the history, right-padded with 0.\n  \
Both: exclude_ids [batch, E] = items to leave out (usually the history), right-padded with 0.\n\
Outputs: topk_scores [batch, k] float and topk_items [batch, k] int64 (--k), or scores [batch, N+1] \
(--all-scores).\n\n\
--candidates adds the input candidate_ids [batch, C] (internal indices, right-padded with 0, C >= k): \
only their rows of the output layer are gathered and scored (Gather + MatMul + TopK), topk_items are \
taken from them, and --all-scores gives scores [batch, C] in candidate order. --embedding adds the \
output user_embedding [batch, d + 1] = [h, 1], whose inner product with an item's row of \
`recsys export-items` is its score.\n\n\
TensorRT route (TensorRT is not bundled): trtexec --onnx=model.onnx --saveEngine=model.plan \
--minShapes=... --optShapes=... --maxShapes=... (see docs/guide/src/onnx.md for the precision flags), then serve \
model.plan with platform \"tensorrt_plan\"; see docs/guide/src/onnx.md."
)]
pub struct ExportOnnxArgs {
    /// Engine directory written by `recsys convert`.
    #[arg(long)]
    pub engine: PathBuf,
    /// Write the ONNX model here (weights above 1 GiB go to FILE.data beside it).
    #[arg(
        long,
        visible_alias = "out",
        value_name = "FILE",
        required_unless_present = "model_repository",
        conflicts_with = "model_repository"
    )]
    pub output: Option<PathBuf>,
    /// Write a Triton model instead: DIR/NAME/VERSION/model.onnx, DIR/NAME/config.pbtxt (onnxruntime
    /// backend) and DIR/NAME/item_ids.tsv. DIR may be s3://... or gs://... (written locally, then
    /// uploaded).
    #[arg(long, value_name = "DIR")]
    pub model_repository: Option<PathBuf>,
    /// Model name in the repository (default: the engine kind and precision, e.g. bert4rec_onnx_fp32).
    #[arg(long, requires = "model_repository")]
    pub model_name: Option<String>,
    /// Version directory of the model in the repository.
    #[arg(long, default_value_t = 1, requires = "model_repository")]
    pub version: u64,
    /// max_batch_size of the Triton config, and the largest batch of the TensorRT build profile
    /// printed with the export.
    #[arg(long, default_value_t = 64)]
    pub max_batch_size: usize,
    /// Triton instances on the GPU (onnxruntime's CUDA execution provider) instead of the CPU.
    #[arg(long, requires = "model_repository")]
    pub gpu: bool,
    /// Items the graph returns per history.
    #[arg(long, default_value_t = 100)]
    pub k: usize,
    /// Return every item's score ([batch, N+1]) instead of the top-k.
    #[arg(long, conflicts_with = "k")]
    pub all_scores: bool,
    /// Rank only a candidate_ids input's items (re-ranking a retrieval stage's candidates).
    #[arg(long)]
    pub candidates: bool,
    /// Add the user_embedding output ([batch, d + 1], for an ANN retrieval stage).
    #[arg(long)]
    pub embedding: bool,
    /// Put the weights in a side file (FILE.data) even when the model is small.
    #[arg(long)]
    pub external_data: bool,
    /// Mult-VAE: how the graph drops duplicate history items. scatter: one [batch, N+1] int64
    /// row per history, linear in the history's length; pairs: [batch, T, T] comparisons, no
    /// memory per item but quadratic in the padded length T; auto: scatter below 65,536 items.
    #[arg(long, value_enum, default_value_t = DedupArg::Auto)]
    pub dedup: DedupArg,
    /// Replace an existing output file or version directory.
    #[arg(long)]
    pub force: bool,
    /// Print what was written as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(
    after_help = "Writes DIR/report.md, DIR/report.json, DIR/pareto.svg and the engines (DIR/engines/<variant>). \
Quality: NDCG/Recall@10/20/100 and MRR on the test set, deltas to fp32, top-10/100 overlap with fp32 (Jaccard, \
share of identical top-10), |score error|. Cost: weights size, resident memory, p50/p99 latency and throughput \
per batch size. The recommendation is the fastest variant (p50 at the first --batch-size) whose NDCG@10 loss stays \
within --budget-ndcg10, with the command that converts it."
)]
pub struct SweepArgs {
    /// Model architecture of the checkpoint (as for `recsys convert`: optional for a RecBole
    /// checkpoint, whose own config names it).
    #[arg(long, value_enum)]
    pub kind: Option<Kind>,
    /// Trained weights (as for `recsys convert`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Hyper-parameters as JSON (as for `recsys convert`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The item map (as for `recsys convert`).
    #[command(flatten)]
    pub items: ItemMapArgs,
    /// Leave-one-out test file (as for `recsys eval`).
    #[arg(long)]
    pub test: PathBuf,
    /// Calibration histories (predict JSONL), needed for --int8-modes w8a8.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Precisions to compare, as `recsys convert --precision` takes them; fp32 first (the
    /// reference of every comparison).
    #[arg(
        long,
        value_parser = precision_parser(),
        value_delimiter = ',',
        default_value = "fp32,fp16,bf16,int8"
    )]
    pub precisions: Vec<Precision>,
    /// How int8 is applied, as `recsys convert --int8-mode` takes it: one variant per mode (w8a8
    /// and w8a8-all: one per calibration method).
    #[arg(
        long,
        value_parser = int8_mode_parser(),
        value_delimiter = ',',
        default_value = "weight-only,w8a8,w8a8-all"
    )]
    pub int8_modes: Vec<Int8Mode>,
    /// Calibration methods for the w8a8 variants.
    #[arg(
        long,
        value_parser = calibration_method_parser(),
        value_delimiter = ',',
        default_value = "minmax,percentile,entropy"
    )]
    pub calibration_methods: Vec<CalibrationChoice>,
    /// Top-k screens, as `recsys convert --screen` takes them: `int8` adds a screened variant of
    /// each fp32 and fp16 variant (the same answers; the timing shows whether it pays).
    #[arg(long, value_parser = screen_parser(), value_delimiter = ',', default_value = "none,int8")]
    pub screens: Vec<Screen>,
    /// Batch sizes to time.
    #[arg(
        long,
        visible_alias = "batch",
        value_delimiter = ',',
        default_value = "1,8,64"
    )]
    pub batch_size: Vec<usize>,
    /// Largest NDCG@10 loss relative to fp32 the recommendation may have.
    #[arg(long, default_value = "1%")]
    pub budget_ndcg10: String,
    /// Users compared with fp32 for overlap and score error.
    #[arg(long, default_value_t = 500)]
    pub compare_users: usize,
    /// Seconds of timing per variant and batch size.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Scoring threads (default: the available cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: Option<u32>,
    /// Directory for the report, the chart and the engines.
    #[arg(long, visible_alias = "out", value_name = "DIR")]
    pub output: PathBuf,
}

const REPOSITORY_HELP: &str = "The repository is a local directory or object storage, in \
tritonserver's own --model-repository syntax (pass the servers the same string): s3://bucket/path \
(AWS), s3://host:port/bucket/path or s3://https://host:port/bucket/path (S3-compatible endpoints; \
plain HTTP unless https:// is given), gs://bucket/path. Credentials come from the standard \
environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION, \
web identity, instance metadata; GOOGLE_APPLICATION_CREDENTIALS) and AWS's shared files \
(~/.aws/credentials and ~/.aws/config, profile AWS_PROFILE).\n\n\
A publish takes no lock: it claims its version number with a create-if-absent write of \
<model>/<version>/recsys-version.json (two concurrent publishers get distinct versions), uploads \
the engine under it, checks every file and size, and only then marks it pending. A version \
folder without that record (written by `recsys convert --output`, or an upload in progress) is \
incomplete and never approvable. config.pbtxt's version_policy names the newest approved version \
and changes by one atomic write. A command killed at any point leaves the config on a complete \
version (the old or the new one).\n\n\
Lease: approve, reject, rollback and prune take the model's lease (<model>/recsys-lease.json, \
created only if absent, naming the holder, its command and its expiry) and renew it before each \
replica. A second command waits for it (--lease-wait, default 300 s) and then fails naming the \
holder (exit 6); a lease whose holder was killed expires by itself, and --force takes over one \
whose holder is known to be dead.\n\n\
Gates: before the config names a version, approve (and publish --approve) reads every stored \
file of the version it will name back and checks its size and SHA-256 against what was \
published; with replicas, the canary (--canary URL: a tritonserver outside the traffic \
Service; or, with --canary-on-traffic, the first live traffic replica) then loads it without the \
repository changing (Triton's load API with a config override) and must answer the version's \
self-check request as the publisher's engine did, with finite scores; it is then put back on the \
serving version. With an evaluation set (publish --eval-set, else the serving version's, else the \
newest other version's), the \
canary then answers its held-out histories with the candidate and with the serving version: a \
candidate whose NDCG@10 is more than --max-ndcg-drop (5 % relative) below the serving version's, \
or whose scores are degenerate (non-finite, or every top-10 score the same number), is refused; \
both numbers are recorded on the version (--skip-quality-gate approves without it, recorded too). \
A failed gate leaves the repository as it was and records the reason on the \
version (`recsys versions`). reject and rollback verify the version they go back to.\n\n\
Replicas: --server may be repeated, and a name that resolves to several addresses (a Kubernetes \
headless Service) stands for one replica per address; --servers-file lists more. The fleet is \
resolved again at every pass. Before each replica the command renews its lease and reads the \
config again, and stops if another command took over. Each replica (tritonserver in explicit \
model-control mode) reloads the model in turn and counts when it serves the version and no \
other, within --reload-timeout; a replica that is not live (starting, terminating) is \
unreachable, not failed. The first failure stops the rollout and an approve then rolls itself \
back: the version is marked rolled-back, the config names the previous approved version again \
and every replica, resolved again, is brought back onto it (--rollout continue goes on to the \
rest instead and never rolls back). Every command ends with a reconcile pass: the fleet and the \
canary resolved again, each replica compared with the config and reloaded where it differs.\n\n\
Exit status: 0 every replica serves what the repository names, 1 nothing changed (an \
unreadable repository, an unknown version), 2 bad flags, 3 a gate refused the version (the \
repository is unchanged), 4 the repository changed but not every replica serves it (a replica \
failed or is unreachable; run the command again once they are back), 5 a replica failed and the \
approve rolled back, 6 another command holds the model's lease (nothing changed), 7 an error \
after the config switched (the report says what was done; run the command again), 8 the canary \
could not be put back on the serving version (recorded on the version), 9 another command took \
the fleet over during this one (this one stopped).";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RolloutArg {
    /// Stop at the first replica that fails; the rest keep what they serve.
    Stop,
    /// Go on to every replica, whatever failed before.
    Continue,
}

/// The replicas a release command reaches (publish --approve, approve, reject, rollback).
#[derive(Args, Debug)]
pub struct FleetArgs {
    /// A traffic replica to bring onto the version the repository names afterwards, e.g.
    /// http://127.0.0.1:8000; repeat for a fleet, or name a headless Service (one replica per
    /// address, resolved again at every pass, so pods the autoscaler adds are reached).
    #[arg(long = "server", value_name = "URL")]
    pub servers: Vec<String>,
    /// A file listing one replica URL per line (as a service-discovery agent writes it), read
    /// again at every pass like --server.
    #[arg(long, value_name = "FILE")]
    pub servers_file: Option<PathBuf>,
    /// The canary replica of an approve: a tritonserver outside the traffic Service (no client
    /// reaches it) that loads the candidate and answers its self-check before the repository
    /// names it. Reconciled with the fleet at the end.
    #[arg(long, value_name = "URL")]
    pub canary: Option<String>,
    /// Without --canary, test the candidate on the first live traffic replica: its clients may
    /// get answers from the unapproved version while it is tested.
    #[arg(long, conflicts_with = "canary")]
    pub canary_on_traffic: bool,
    /// What a failed replica does to the rest of the rollout.
    #[arg(long, value_enum, default_value = "stop")]
    pub rollout: RolloutArg,
    /// The longest one replica may take to load a version, in seconds (default: the manifests'
    /// startup allowance).
    #[arg(long, value_name = "SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub reload_timeout: u64,
    #[command(flatten)]
    pub lease: LeaseArgs,
    /// A Prometheus Pushgateway (http://host:9091) to push the command's outcome to: the version
    /// the repository names afterwards, the exit status, the replicas serving it (default:
    /// RECSYS_PUSHGATEWAY). The alert rules compare it with what the pods serve.
    #[arg(long, value_name = "URL")]
    pub pushgateway: Option<String>,
}

/// How an approve's canary runs the quality gate (champion/challenger).
#[derive(Args, Debug)]
pub struct QualityArgs {
    /// The largest relative drop of the candidate's NDCG@10 below the serving version's, on the
    /// same held-out histories, that the quality gate lets through (0.05: 5 %).
    #[arg(long, value_name = "FRACTION", default_value_t = recsys_registry::quality::DEFAULT_MAX_NDCG_DROP, value_parser = max_ndcg_drop, allow_negative_numbers = true)]
    pub max_ndcg_drop: f64,
    /// Held-out histories of the evaluation set the canary sends to each version.
    #[arg(long, value_name = "N", default_value_t = recsys_registry::quality::DEFAULT_QUALITY_HISTORIES as u64, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub quality_histories: u64,
    /// Approve without the quality gate (recorded on the version).
    #[arg(long)]
    pub skip_quality_gate: bool,
}

/// How a command that changes a model's fleet takes the model's lease.
#[derive(Args, Debug)]
pub struct LeaseArgs {
    /// How long to wait for another command's lease on the model before giving up (exit 6).
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub lease_wait: u64,
    /// Take the model's lease over even though its holder has not released it: only when that
    /// command is known to be dead (it stops at its next step if it is not).
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug)]
#[command(after_help = REPOSITORY_HELP)]
pub struct PublishArgs {
    /// The Triton model repository: a directory, s3://... or gs://... (see below).
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository holding config.pbtxt). The first version of a
    /// model must be published with --approve; a model without config.pbtxt gets a minimal one
    /// (backend "recsys", --max-batch-size) that the backend completes from the engine.
    #[arg(long)]
    pub model: String,
    /// Engine directory written by `recsys convert`.
    #[arg(long)]
    pub engine: PathBuf,
    /// Approve at once (otherwise the version is pending and does not serve).
    #[arg(long)]
    pub approve: bool,
    /// JSON metrics to record with the version (e.g. the output of `recsys eval --output`).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Held-out histories with their next items, in `recsys eval --test`'s format, stored with
    /// the version: the quality gate compares the candidate's NDCG@10 on them with the serving
    /// version's (without one, the serving version's set is used).
    #[arg(long, value_name = "TSV")]
    pub eval_set: Option<PathBuf>,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub quality: QualityArgs,
    /// max_batch_size of the config.pbtxt written when the model has none yet (a minimal config
    /// that the backend completes from the engine).
    #[arg(long, default_value_t = recsys_registry::config::DEFAULT_MAX_BATCH_SIZE)]
    pub max_batch_size: u32,
    /// Print the outcome as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(after_help = REPOSITORY_HELP)]
pub struct StatusArgs {
    /// The Triton model repository: a directory, s3://... or gs://... (see below).
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// The version to approve or reject.
    #[arg(long)]
    pub version: u64,
    /// max_batch_size of the config.pbtxt written when the model has none yet (its first
    /// approval).
    #[arg(long, default_value_t = recsys_registry::config::DEFAULT_MAX_BATCH_SIZE)]
    pub max_batch_size: u32,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub quality: QualityArgs,
    /// Print the outcome as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(after_help = REPOSITORY_HELP)]
pub struct RollbackArgs {
    /// The Triton model repository: a directory, s3://... or gs://... (see below).
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// The approved version to serve (default: the newest approved version older than the
    /// serving one).
    #[arg(long)]
    pub to: Option<u64>,
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Print the outcome as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(after_help = REPOSITORY_HELP)]
pub struct VersionsArgs {
    /// The Triton model repository: a directory, s3://... or gs://... (see below).
    #[arg(long)]
    pub repository: String,
    /// Model name (a folder of the repository).
    #[arg(long)]
    pub model: String,
    /// Remove old versions: tritonserver copies every version folder of a model at each load,
    /// so old versions of large engines slow every reload. Needs --keep.
    #[arg(long, requires = "keep")]
    pub prune: bool,
    /// With --prune: keep the N newest versions; older ones go, except the serving version, the
    /// previous approved one (the rollback target), pending and incomplete ones.
    #[arg(long, value_name = "N", requires = "prune", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// With --prune: print what would be removed, remove nothing.
    #[arg(long, requires = "prune")]
    pub dry_run: bool,
    /// With --prune: a replica whose loaded versions are kept too; repeat for a fleet, or name a
    /// headless Service.
    #[arg(long = "server", value_name = "URL", requires = "prune")]
    pub servers: Vec<String>,
    #[command(flatten)]
    pub lease: LeaseArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Kind {
    /// RecBole BERT4Rec (sequential; order of the history matters).
    Bert4rec,
    /// RecBole MultiVAE / Mult-VAE (collaborative filtering; the history is a set); RecBole's
    /// own names `multivae` and `mult-vae` are accepted too.
    #[value(alias = "multivae", alias = "mult-vae")]
    Vaecf,
    /// RecBole SASRec (sequential; causal self-attention, answers from the last item).
    Sasrec,
    /// RecBole GRU4Rec (sequential; a GRU over the history, answers from the last item).
    Gru4rec,
    /// HSTU from Meta's generative-recommenders (sequential; reads each event's timestamp).
    Hstu,
}

impl From<Kind> for recsys_engine::ModelKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Bert4rec => recsys_engine::ModelKind::Bert4rec,
            Kind::Vaecf => recsys_engine::ModelKind::Vaecf,
            Kind::Sasrec => recsys_engine::ModelKind::Sasrec,
            Kind::Gru4rec => recsys_engine::ModelKind::Gru4rec,
            Kind::Hstu => recsys_engine::ModelKind::Hstu,
        }
    }
}

// The conversion options' values are the engine's own types (`ConvertOptions` holds their
// defaults and the combinations refused, for the CLI and the Python package alike); these parsers
// give clap their names and the help shown for each.

/// `--screen`.
fn screen_parser() -> impl TypedValueParser<Value = Screen> {
    PossibleValuesParser::new([
        PossibleValue::new("none").help("Score every item at the engine's precision"),
        PossibleValue::new("int8").help("Screen with int8 weights, rescore the survivors exactly"),
    ])
    .map(|s| s.parse().expect("one of the listed values"))
}

/// `--precision`.
fn precision_parser() -> impl TypedValueParser<Value = Precision> {
    PossibleValuesParser::new([
        PossibleValue::new("fp32").help("32-bit floats, PyTorch-exact within f32 rounding"),
        PossibleValue::new("fp16").help(
            "Every weight matrix stored as IEEE half (half the bytes), widened to f32 to compute",
        ),
        PossibleValue::new("bf16").help(
            "Every weight matrix stored as bfloat16 (half the bytes); each layer's input is \
             rounded to bfloat16 and the products summed in f32 (AVX512-BF16's vdpbf16ps where \
             the CPU has it, the same result widened to f32 elsewhere)",
        ),
        PossibleValue::new("int8").help(
            "Every weight matrix stored as int8 with one scale per row (a quarter of the bytes), \
             multiplied in integer arithmetic against int16 (weight-only) or int8 (w8a8) \
             activations",
        ),
    ])
    .map(|s| s.parse().expect("one of the listed values"))
}

/// `--int8-mode`.
fn int8_mode_parser() -> impl TypedValueParser<Value = Int8Mode> {
    PossibleValuesParser::new([
        PossibleValue::new("weight-only").help(
            "Quantize the weights; each request's activations get their own int16 scale (no \
             calibration)",
        ),
        PossibleValue::new("w8a8").help(
            "Weights and the output layer's activations in int8, with a static activation scale \
             from --calibration (every dense layer's scale is calibrated too and recorded for \
             ONNX exports; dense layers keep each request's own int16 scale)",
        ),
        PossibleValue::new("w8a8-all").help(
            "As w8a8, and every dense layer's input also at its calibrated static int8 scale: \
             what an explicit-quantization ONNX export (`recsys export-onnx`, TensorRT INT8) \
             computes",
        ),
    ])
    .map(|s| s.parse().expect("one of the listed values"))
}

/// `--calibration-method`.
fn calibration_method_parser() -> impl TypedValueParser<Value = CalibrationChoice> {
    PossibleValuesParser::new([
        PossibleValue::new("minmax")
            .help("Clip at the largest activation magnitude seen (ONNX Runtime's default)"),
        PossibleValue::new("percentile").help(
            "Clip at a high percentile of the magnitudes (--calibration-percentile), ignoring \
             rare outliers",
        ),
        PossibleValue::new("entropy").help(
            "Clip where the 8-bit histogram loses the least information (KL divergence; \
             TensorRT's default)",
        ),
    ])
    .map(|s| s.parse().expect("one of the listed values"))
}

/// Where the item map comes from: exactly one of the two flags.
#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct ItemMapArgs {
    /// TSV of `internal_index<TAB>external_item_id` for items 1..N (a header line is allowed).
    #[arg(long, value_name = "TSV")]
    pub item_map: Option<PathBuf>,
    /// Instead of --item-map: the file RecBole saved for the training data, with
    /// `save_dataset: True` (<dataset>-<DatasetClass>.pth) or `save_dataloaders: True`
    /// (<dataset>-for-<model>-dataloader.pth). Its `field2id_token` for the item field is the map.
    /// Read as data: nothing in the file is executed, and RecBole is not needed.
    #[arg(long, value_name = "FILE")]
    pub recbole_dataset: Option<PathBuf>,
}

impl ItemMapArgs {
    pub fn source(&self) -> recsys_engine::ItemMapSource<'_> {
        match (&self.item_map, &self.recbole_dataset) {
            (Some(tsv), _) => recsys_engine::ItemMapSource::Tsv(tsv),
            (None, Some(saved)) => recsys_engine::ItemMapSource::RecboleDataset(saved),
            (None, None) => unreachable!("clap requires one of --item-map and --recbole-dataset"),
        }
    }

    /// The flag and path, as a command line would give them.
    pub fn flag(&self) -> String {
        match self.source() {
            recsys_engine::ItemMapSource::Tsv(p) => format!("--item-map {}", p.display()),
            recsys_engine::ItemMapSource::RecboleDataset(p) => {
                format!("--recbole-dataset {}", p.display())
            }
        }
    }
}

#[derive(Args, Debug)]
#[command(
    after_help = "Checkpoints are read as data: pickle code in .pt/.pth files is never executed. \
The format is detected from the file's content, so the extension does not matter.\n\n\
The engine directory holds manifest.json (hyper-parameters, precision, source checksum, per-file \
sha256), weights.safetensors and item_ids.tsv; loading it verifies every checksum."
)]
pub struct ConvertArgs {
    /// Model architecture of the checkpoint. Optional for a RecBole checkpoint, whose own config
    /// names it (BERT4Rec, MultiVAE, SASRec, GRU4Rec), and for an HSTU, whose tensor names do;
    /// checked against them when given.
    #[arg(long, value_enum)]
    pub kind: Option<Kind>,
    /// Trained weights: .safetensors, a torch.save state dict (.pt/.pth), or a RecBole checkpoint.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Hyper-parameters as JSON (n_heads, max_seq_length, ...). Optional for RecBole checkpoints,
    /// which carry their own; anything the weights' shapes determine is checked against them.
    #[arg(long, conflicts_with = "gin")]
    pub config: Option<PathBuf>,
    /// HSTU: the gin config file the model was trained with (its bindings are read as data:
    /// max_sequence_length, num_blocks, num_heads, dqk, dv, ...), instead of --config.
    #[arg(long, value_name = "FILE")]
    pub gin: Option<PathBuf>,
    /// The item map: external item ids by the model's internal index.
    #[command(flatten)]
    pub items: ItemMapArgs,
    /// Engine directory to create (for serving: <model_repository>/<model>/<version>), or its
    /// folder in object storage (s3://..., gs://...: converted and verified locally, then
    /// uploaded). To add a version to a served model, prefer `recsys publish`.
    #[arg(long, visible_alias = "out", value_name = "DIR")]
    pub output: PathBuf,
    /// Numeric precision of every weight matrix (item embedding, dense layers, output layer);
    /// biases and norms stay fp32. `recsys sweep` shows what each costs in ranking quality.
    #[arg(long, value_parser = precision_parser(), default_value_t = ConvertOptions::default().precision)]
    pub precision: Precision,
    /// How int8 is applied (with --precision int8).
    #[arg(long, value_parser = int8_mode_parser(), default_value_t = ConvertOptions::default().int8_mode)]
    pub int8_mode: Int8Mode,
    /// Find each top k by screening an int8 copy of the output layer and rescoring the survivors
    /// from the fp32/fp16 weights: the same answers, bit for bit, reading a quarter of the bytes
    /// (fp32 and fp16 engines; see docs/QUANTIZATION.md).
    #[arg(long, value_parser = screen_parser(), default_value_t = ConvertOptions::default().screen)]
    pub screen: Screen,
    /// Calibration histories for --int8-mode w8a8: JSON lines in the `recsys predict` input format.
    /// Use a few thousand real histories; their activations set the static scale.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// How the calibration picks the activation clipping threshold.
    #[arg(
        long,
        value_parser = calibration_method_parser(),
        default_value_t = ConvertOptions::default().calibration_method
    )]
    pub calibration_method: CalibrationChoice,
    /// Percentile for --calibration-method percentile.
    #[arg(long, default_value_t = ConvertOptions::default().calibration_percentile)]
    pub calibration_percentile: f64,
    /// An interaction log (CSV, TSV, or RecBole's atomic .inter file) whose item column is counted
    /// into the popularity list stored with the engine: the answer to a visitor without history
    /// (empty_history_policy popular).
    #[arg(long, value_name = "FILE")]
    pub interactions: Option<PathBuf>,
    /// The interaction log's item column (default: item_id:token, item_id, item or itemid).
    #[arg(long, value_name = "NAME", requires = "interactions")]
    pub interactions_item_column: Option<String>,
    /// Item attributes to store with the engine: a Parquet, CSV or TSV table whose first column
    /// is the external item id and whose other columns hold strings, integers or lists (a CSV/TSV
    /// list is `a|b`). Every value becomes an item set requests filter by (`category=shoes`).
    #[arg(long, value_name = "FILE")]
    pub item_attributes: Option<PathBuf>,
    /// Refuse checkpoints larger than this many bytes (they are read into memory whole).
    #[arg(long, default_value_t = recsys_engine::import::DEFAULT_MAX_CHECKPOINT_BYTES)]
    pub max_checkpoint_bytes: u64,
    /// Replace the output directory if it already exists.
    #[arg(long)]
    pub force: bool,
    /// Print what was written as one JSON object on stdout (for scripts).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Clone, Debug)]
#[command(
    after_help = "Input: one JSON object per line with \"item_ids\" (the history, oldest first, as \
numbers or strings); optional \"k\", \"exclude_item_ids\", \"candidate_item_ids\" (rank only \
these items, as a re-ranker after a retrieval stage) and \"return_embedding\". Every other field (\"user_id\", ...) is copied \
to the output.\n\
Output: one line per input line, in input order: {\"item_ids\": [...best first], \"scores\": [...], ...}. \
A line that cannot be served gets {\"error\": \"...\", \"line\": N} in its place and the run goes on.\n\n\
Exit status: 0 all lines served, 3 some lines failed (a summary goes to stderr), 1 the run could not \
start or stopped (unreadable engine or input, unwritable output)."
)]
pub struct PredictArgs {
    /// Engine directory written by `recsys convert`, or its folder in object storage
    /// (s3://..., gs://...: downloaded to a scratch folder under TMPDIR first).
    #[arg(long)]
    pub engine: PathBuf,
    /// JSON-lines input; `-` reads standard input; s3://... or gs://... is downloaded first.
    #[arg(long)]
    pub input: PathBuf,
    /// JSON-lines output; `-` writes standard output; s3://... or gs://... is written locally and
    /// uploaded whole once every line is scored (so a reader never sees a partial file).
    #[arg(long, visible_alias = "out")]
    pub output: PathBuf,
    /// Items to return per user (a line's own "k" wins).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub k: u32,
    /// Lines scored together; memory stays bounded by this, whatever the file size.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub batch_size: u32,
    /// Also recommend items that are in the user's history.
    #[arg(long)]
    pub include_seen: bool,
    /// Fail a line whose history holds ids unknown to the model, instead of dropping those ids.
    #[arg(long)]
    pub strict_ids: bool,
    /// Who answers a history with no known item: popular (the engine's popularity list, from
    /// convert --interactions), model (the model's own answer; SASRec and GRU4Rec have none),
    /// error, or auto (popular when the engine has the list, else model).
    #[arg(long, default_value = "auto", value_parser = ["auto", "popular", "model", "error"])]
    pub empty_history_policy: String,
    /// Screened engines (`convert --screen int8`): run the int8 screen where it measured faster on
    /// this CPU (auto, the plan kept for the next run), always, or never. The answers are the same.
    #[arg(long, default_value = "auto", value_parser = ["auto", "always", "never"])]
    pub screen_policy: String,
    /// A bf16 engine on a CPU with AVX512-BF16: its kernels per batch size by measurement on this
    /// CPU (auto, the plan kept for the next run), `vdpbf16ps` (native) or bf16 widened to f32 (widened). The
    /// answers are the same.
    #[arg(long, default_value = "auto", value_parser = ["auto", "native", "widened"])]
    pub bf16_path: String,
    /// On a CPU with AMX (Xeons since Sapphire Rapids): a bf16 engine's layers, an int8 or W8A8
    /// engine's output layer, or a screened engine's int8 screen, on AMX tiles per batch size by
    /// measurement on this CPU (auto, the plan kept for the next run), always (on) or never (off).
    /// bf16 scores on tiles differ from the SIMD tables' in the last bits; int8 answers keep theirs.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub amx: String,
    /// AVX-512 kernels: the largest row group a batch is cut into, by measurement on this CPU
    /// (auto, the plan kept for the next run), 4 or 8 rows. The answers are the same.
    #[arg(long, default_value = "auto", value_parser = ["auto", "4", "8"])]
    pub row_block: String,
    /// A live availability object to filter by, as the servers do (a file, or s3://.../gs://...;
    /// see `recsys availability`): its sets join the engine's, so `include_item_sets` and
    /// `exclude_item_sets` may name them (`stock=out`).
    #[arg(long, value_name = "SOURCE")]
    pub availability: Option<String>,
    /// A catalogue delta to answer with, as the servers do: items added, replaced or retired
    /// since the engine was converted. A Parquet table (`.parquet`, in the schema `recsys
    /// export-items --format parquet --with-input-rows` writes, with an optional `op` column:
    /// upsert or retire) or a published catalogue object (a file, s3://..., gs://...; see
    /// `recsys catalogue`).
    #[arg(long, value_name = "SOURCE")]
    pub catalogue: Option<String>,
    /// Scoring threads (default: the available cores); each scores whole batches, output order
    /// is kept.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: Option<u32>,
    /// Process only shard I of N (records I, I+N, I+2N, ... counting non-blank lines from 0), so N
    /// copies can run as parallel jobs (e.g. a Kubernetes Indexed Job) on the same input.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<String>,
    /// Continue an interrupted run: keep the complete lines already in --output (a partial last
    /// line is cut), skip as many records, and append the rest.
    #[arg(long)]
    pub resume: bool,
    /// Add every user's embedding ("embedding": the final hidden vector and a trailing 1, whose
    /// inner product with a row of `recsys export-items` is the model's score); a line's own
    /// "return_embedding": true asks for it for that line alone.
    #[arg(long)]
    pub return_embedding: bool,
    /// Also answer each history after every one of its events ("timeline": one entry per event
    /// with its "item_ids" and "scores"): replaying a log, simulating, precomputing. GRU4Rec runs
    /// it in one incremental pass (each event computed once); the other models recompute every
    /// prefix.
    #[arg(long)]
    pub timeline: bool,
}

#[derive(Args, Debug)]
#[command(
    after_help = "The test file has `user_id<TAB>target_item_id<TAB>history` lines (history: \
space-separated external ids, oldest first; a header line is allowed). Each target is ranked against \
every item except PAD and the user's history; rank0 counts items scoring strictly higher. \
NDCG@k = 1/log2(rank0+2) if rank0 < k, Recall@k = HR@k = [rank0 < k], MRR = 1/(rank0+1). \
Targets unknown to the model count as misses. Prints JSON to stdout."
)]
pub struct EvalArgs {
    /// Engine directory written by `recsys convert`.
    #[arg(long)]
    pub engine: PathBuf,
    /// Leave-one-out test file.
    #[arg(long)]
    pub test: PathBuf,
    /// Cut-offs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,20,100")]
    pub k: Vec<usize>,
    /// Users scored together.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub batch_size: u64,
    /// Also write the JSON report to this file.
    #[arg(long, visible_alias = "out")]
    pub output: Option<PathBuf>,
    /// Scoring threads (default: the available cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: Option<u32>,
    /// Evaluate as a filtered page ranks: only items of these item sets compete (comma-separated
    /// `column=value` names; AND across columns, OR within one); users whose held-out item the
    /// filter leaves out are not counted (reported as targets_outside_filter).
    #[arg(long, value_delimiter = ',', value_name = "SETS")]
    pub include_item_sets: Vec<String>,
    /// Evaluate without the items of these item sets (comma-separated names), as above.
    #[arg(long, value_delimiter = ',', value_name = "SETS")]
    pub exclude_item_sets: Vec<String>,
}

/// `--threads` when not given: the cores this process may use.
pub fn default_threads(threads: Option<u32>) -> usize {
    threads.map(|t| t as usize).unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    })
}

/// `recsys export-onnx --dedup`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DedupArg {
    Auto,
    Scatter,
    Pairs,
}

/// `--max-ndcg-drop`: a fraction in [0, 1) (see `quality::check_max_drop`).
fn max_ndcg_drop(text: &str) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    recsys_registry::quality::check_max_drop(value)
}
