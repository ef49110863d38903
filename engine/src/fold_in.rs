//! Fold-in: rows for items an engine lacks, estimated from their first interactions with the model
//! frozen (`recsys catalogue fold-in`), as a catalogue delta ([`crate::catalogue`]).
//!
//! The new item's output row `w` (and bias `b`, where the model has one) maximise the model's own
//! log-likelihood of the log with the other weights frozen, as training on the log would for that
//! row alone. Every context is the hidden vector `h` the model computes for what a user had done
//! (sequential models: the known items before an event, in time order; Mult-VAE, which ignores
//! order: the user's known items) and `log Z`, the log of the summed exponentiated scores of every
//! item of the engine for that `h`. With `s = w . h + b`, a context contributes
//!
//! ```text
//! pos * s - n * log(Z + exp(s))          (up to terms free of w and b)
//! ```
//!
//! where `pos` is 1 when the new item is what the user did next (Mult-VAE: is in the user's bag)
//! and `n` the events the context predicts (1; Mult-VAE: the bag's size). The contexts with the
//! new item are its positives (its first `max_examples`); every other context pushes its score
//! down, and those are estimated from a uniform sample of the log's contexts (`negative_samples`,
//! each weighted by the log's count over the sample's). With an L2 penalty the objective is
//! concave; Newton's method (conjugate gradients on the Hessian, a backtracking line search, in
//! f64) finds its maximum. Each new item is fitted against the engine's catalogue, not against
//! the other new items. Where the model reads an item's input row from its output row (BERT4Rec,
//! SASRec, GRU4Rec) the same fit gives both; Mult-VAE's input row (its first encoder layer's
//! column) is the mean input row of the known items the new item's users also interacted with
//! (co-occurrence). HSTU, whose scored row is a normalised input row, is refused.

use std::collections::HashMap;

use crate::catalogue::{ItemOp, ItemRow};
use crate::config::ModelKind;
use crate::error::{EngineError, Result};
use crate::idmap::{ExternalId, IdType};
use crate::interactions::UserLog;
use crate::models::{Model, ModelView};
use crate::Engine;

/// Histories encoded and scored together.
const BATCH: usize = 256;
/// Newton iterations at most (the fit converges in well under 20 on the fixtures).
const MAX_ITERATIONS: usize = 50;
/// Conjugate-gradient steps per Newton iteration at most.
const MAX_CG_STEPS: usize = 100;

/// How fold-in fits.
#[derive(Clone, Debug, PartialEq)]
pub struct FoldInOptions {
    /// The L2 penalty on the fitted row (and bias).
    pub l2: f64,
    /// Positive contexts per new item at most: its first ones in the log.
    pub max_examples: usize,
    /// Contexts of the log sampled to stand for every context the new item is not in.
    pub negative_samples: usize,
}

impl Default for FoldInOptions {
    fn default() -> Self {
        FoldInOptions {
            l2: 1.0,
            max_examples: 1000,
            negative_samples: 5000,
        }
    }
}

/// Where a folded item's input row comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputRowSource {
    /// The model reads the input row from the output row: the same fit.
    Tied,
    /// The mean input row of the known items its users also interacted with.
    CoOccurrence,
}

/// One new item's fitted rows and how they were found.
#[derive(Clone, Debug, PartialEq)]
pub struct FoldedItem {
    pub row: ItemRow,
    /// Interactions with the item in the log.
    pub interactions: usize,
    /// Positive contexts fitted (interactions with something known before them, up to the cap).
    pub examples: usize,
    pub input_source: InputRowSource,
    /// The penalised log-likelihood reached (up to a constant), and Newton iterations taken.
    pub log_likelihood: f64,
    pub iterations: usize,
}

/// What fold-in found in a log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FoldIn {
    pub items: Vec<FoldedItem>,
    /// New items with no usable example (nothing known before any of their interactions), or an
    /// id the engine's id type cannot hold, with the reason.
    pub skipped: Vec<(String, String)>,
    pub users: usize,
    /// Interactions with items the engine has, and with items it lacks.
    pub known_interactions: usize,
    pub new_interactions: usize,
    /// Contexts of the log that predict a known item, and how many were sampled.
    pub negative_contexts: usize,
    pub negative_samples: usize,
}

/// What a user had done at some point (known items, internal indices), the user, and how many
/// events it predicts.
struct Context {
    items: Vec<u32>,
    user: usize,
    events: f64,
}

/// One context as the fit reads it.
struct Example<'a> {
    h: &'a [f32],
    log_z: f64,
    /// Whether the new item is what the context predicts.
    positive: f64,
    events: f64,
    /// How many contexts of the log it stands for.
    weight: f64,
}

/// Every context's hidden vector (`[len, d]`) and log-partition over the engine's items.
fn encode_contexts(engine: &Engine, contexts: &[&Context]) -> (Vec<f32>, Vec<f64>) {
    let n = engine.ids.len();
    let d = engine.model.output().input_size();
    let mut hidden = Vec::with_capacity(contexts.len() * d);
    let mut log_z = Vec::with_capacity(contexts.len());
    for chunk in contexts.chunks(BATCH) {
        let histories: Vec<&[u32]> = chunk.iter().map(|c| c.items.as_slice()).collect();
        let (h, _) = engine.encode(&histories);
        let scores = engine.score_all_hidden(&h, chunk.len());
        let width = scores.len() / chunk.len();
        for row in scores.chunks_exact(width) {
            log_z.push(log_sum_exp(&row[1..=n]));
        }
        hidden.extend_from_slice(&h);
    }
    (hidden, log_z)
}

/// Folds in every item of `logs` the engine lacks. `progress` gets (items fitted, items in all).
pub fn fold_in(
    engine: &Engine,
    logs: &[UserLog],
    options: &FoldInOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<FoldIn> {
    let kind = engine.kind();
    if kind == ModelKind::Hstu {
        return Err(EngineError::Config(
            "fold-in does not fit HSTU: it scores with a normalised input row, which this fit \
             does not constrain; publish HSTU rows from a retrained model (recsys export-items)"
                .into(),
        ));
    }
    if !(options.l2.is_finite() && options.l2 > 0.0) {
        return Err(EngineError::Config(format!(
            "the L2 penalty must be a positive number, not {}",
            options.l2
        )));
    }
    if options.max_examples == 0 || options.negative_samples == 0 {
        return Err(EngineError::Config(
            "max_examples and negative_samples must be at least 1".into(),
        ));
    }
    let tables = Model::item_tensors(&engine.manifest.model);
    let bag_model = kind == ModelKind::Vaecf;
    let id_type = engine.ids.id_type();
    let mut report = FoldIn {
        users: logs.len(),
        ..Default::default()
    };

    // New items in order of first appearance, each with its positive contexts; every other
    // context of the log is a candidate negative.
    let mut new_index: HashMap<&str, usize> = HashMap::new();
    let mut new_ids: Vec<&str> = Vec::new();
    let mut interactions: Vec<usize> = Vec::new();
    let mut positives: Vec<Vec<Context>> = Vec::new();
    let mut co_items: Vec<Vec<u32>> = Vec::new();
    let mut negatives: Vec<Context> = Vec::new();
    for (user, log) in logs.iter().enumerate() {
        let known: Vec<Option<u32>> = log
            .items
            .iter()
            .map(|id| engine.ids.index_of_str(id))
            .collect();
        let bag: Vec<u32> = known.iter().flatten().copied().collect();
        let mut before: Vec<u32> = Vec::new();
        let mut new_here: Vec<usize> = Vec::new();
        for (id, index) in log.items.iter().zip(&known) {
            if let Some(index) = index {
                report.known_interactions += 1;
                if !bag_model && !before.is_empty() {
                    negatives.push(Context {
                        items: before.clone(),
                        user,
                        events: 1.0,
                    });
                }
                before.push(*index);
                continue;
            }
            report.new_interactions += 1;
            let item = *new_index.entry(id.as_str()).or_insert_with(|| {
                new_ids.push(id.as_str());
                interactions.push(0);
                positives.push(Vec::new());
                co_items.push(Vec::new());
                new_ids.len() - 1
            });
            interactions[item] += 1;
            if bag_model && new_here.contains(&item) {
                continue;
            }
            new_here.push(item);
            if tables.input.is_some() {
                co_items[item].extend_from_slice(&bag);
            }
            let items = if bag_model { &bag } else { &before };
            if items.is_empty() || positives[item].len() >= options.max_examples {
                continue;
            }
            positives[item].push(Context {
                items: items.clone(),
                user,
                // Mult-VAE's likelihood is over the user's whole bag, the new item included.
                events: if bag_model {
                    bag.len() as f64 + 1.0
                } else {
                    1.0
                },
            });
        }
        if bag_model && !bag.is_empty() {
            negatives.push(Context {
                items: bag.clone(),
                user,
                events: bag.len() as f64,
            });
        }
    }
    // A uniform sample (every k-th) stands for them all.
    report.negative_contexts = negatives.len();
    let stride = negatives.len().div_ceil(options.negative_samples).max(1);
    let sampled: Vec<&Context> = negatives.iter().step_by(stride).collect();
    report.negative_samples = sampled.len();
    let negative_weight = negatives.len() as f64 / sampled.len().max(1) as f64;

    let d = engine.model.output().input_size();
    let (negative_hidden, negative_log_z) = encode_contexts(engine, &sampled);
    let with_bias = tables.output_bias.is_some();
    let total = new_ids.len();
    for (item, id) in new_ids.iter().enumerate() {
        progress(item, total);
        let external = match parse_id(id, id_type) {
            Ok(external) => external,
            Err(why) => {
                report.skipped.push((id.to_string(), why));
                continue;
            }
        };
        if positives[item].is_empty() {
            report.skipped.push((
                id.to_string(),
                format!(
                    "none of its {} interaction(s) follows an item the engine knows",
                    interactions[item]
                ),
            ));
            continue;
        }
        let contexts: Vec<&Context> = positives[item].iter().collect();
        let (hidden, log_z) = encode_contexts(engine, &contexts);
        let mut examples: Vec<Example<'_>> = contexts
            .iter()
            .enumerate()
            .map(|(i, c)| Example {
                h: &hidden[i * d..(i + 1) * d],
                log_z: log_z[i],
                positive: 1.0,
                events: c.events,
                weight: 1.0,
            })
            .collect();
        // Mult-VAE: a user with the item is a positive, not also a negative.
        let users_with: Vec<usize> = contexts.iter().map(|c| c.user).collect();
        examples.extend(
            sampled
                .iter()
                .enumerate()
                .filter(|(_, c)| !(bag_model && users_with.contains(&c.user)))
                .map(|(i, c)| Example {
                    h: &negative_hidden[i * d..(i + 1) * d],
                    log_z: negative_log_z[i],
                    positive: 0.0,
                    events: c.events,
                    weight: negative_weight,
                }),
        );
        let fit = fit_row(&examples, with_bias, options.l2);
        let mut vector: Vec<f32> = fit.theta[..d].iter().map(|&v| v as f32).collect();
        vector.push(if with_bias { fit.theta[d] as f32 } else { 0.0 });
        let (input_vector, input_source) = match tables.input {
            None => (None, InputRowSource::Tied),
            Some(_) => (
                Some(co_occurrence_row(engine, &co_items[item])?),
                InputRowSource::CoOccurrence,
            ),
        };
        report.items.push(FoldedItem {
            row: ItemRow {
                id: external,
                op: ItemOp::Upsert,
                vector: Some(vector),
                input_vector,
            },
            interactions: interactions[item],
            examples: contexts.len(),
            input_source,
            log_likelihood: fit.objective,
            iterations: fit.iterations,
        });
    }
    progress(total, total);
    Ok(report)
}

fn parse_id(id: &str, id_type: IdType) -> std::result::Result<ExternalId, String> {
    match id_type {
        IdType::Int64 => id
            .parse::<i64>()
            .map(ExternalId::Int)
            .map_err(|_| "not an integer, and the engine's item ids are int64".to_string()),
        _ => Ok(ExternalId::Str(id.to_string())),
    }
}

fn log_sum_exp(values: &[f32]) -> f64 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = values.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The mean input row (Mult-VAE: first encoder layer's column) of `items`, counted with repeats.
fn co_occurrence_row(engine: &Engine, items: &[u32]) -> Result<Vec<f32>> {
    let ModelView::Vaecf(view) = engine.model.view() else {
        return Err(EngineError::Config(
            "co-occurrence input rows are for Mult-VAE".into(),
        ));
    };
    let cols = view.first_by_item.cols();
    let mut sum = vec![0f32; cols];
    for &item in items {
        view.first_by_item.add_row_into(item as usize, &mut sum);
    }
    let scale = 1.0 / items.len().max(1) as f32;
    Ok(sum.iter().map(|v| v * scale).collect())
}

struct Fit {
    theta: Vec<f64>,
    objective: f64,
    iterations: usize,
}

/// `[h, 1] . theta` (or `h . theta` without a bias).
fn score(theta: &[f64], h: &[f32], with_bias: bool) -> f64 {
    let dot: f64 = h.iter().zip(theta).map(|(&x, t)| x as f64 * t).sum();
    if with_bias {
        dot + theta[h.len()]
    } else {
        dot
    }
}

/// `ln(1 + e^x)` without overflow.
fn softplus(x: f64) -> f64 {
    if x > 30.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The penalised log-likelihood of `theta` ([w] or [w, b]), up to terms free of it.
fn objective(theta: &[f64], examples: &[Example<'_>], with_bias: bool, l2: f64) -> f64 {
    let likelihood: f64 = examples
        .iter()
        .map(|e| {
            let s = score(theta, e.h, with_bias);
            e.weight * (e.positive * s - e.events * softplus(s - e.log_z))
        })
        .sum();
    likelihood - 0.5 * l2 * theta.iter().map(|t| t * t).sum::<f64>()
}

fn add_features(h: &[f32], scale: f64, out: &mut [f64], with_bias: bool) {
    for (o, &x) in out.iter_mut().zip(h) {
        *o += scale * x as f64;
    }
    if with_bias {
        out[h.len()] += scale;
    }
}

/// Newton's method on the concave objective from `theta = 0`, each step solved by conjugate
/// gradients on the negative Hessian `sum c_i x_i x_i^T + l2 I` (never formed).
fn fit_row(examples: &[Example<'_>], with_bias: bool, l2: f64) -> Fit {
    let p = examples[0].h.len() + usize::from(with_bias);
    let mut theta = vec![0f64; p];
    let mut current = objective(&theta, examples, with_bias, l2);
    let mut iterations = 0;
    for _ in 0..MAX_ITERATIONS {
        iterations += 1;
        let mut gradient: Vec<f64> = theta.iter().map(|t| -l2 * t).collect();
        let mut curvature = Vec::with_capacity(examples.len());
        for e in examples {
            let q = sigmoid(score(&theta, e.h, with_bias) - e.log_z);
            add_features(
                e.h,
                e.weight * (e.positive - e.events * q),
                &mut gradient,
                with_bias,
            );
            curvature.push(e.weight * e.events * q * (1.0 - q));
        }
        let hessian_times = |v: &[f64]| -> Vec<f64> {
            let mut out: Vec<f64> = v.iter().map(|x| l2 * x).collect();
            for (e, &c) in examples.iter().zip(&curvature) {
                if c > 0.0 {
                    add_features(e.h, c * score(v, e.h, with_bias), &mut out, with_bias);
                }
            }
            out
        };
        let step = conjugate_gradient(&hessian_times, &gradient);
        let slope: f64 = gradient.iter().zip(&step).map(|(g, s)| g * s).sum();
        if slope <= 0.0 {
            break;
        }
        let mut t = 1.0;
        let mut improved = false;
        for _ in 0..30 {
            let candidate: Vec<f64> = theta.iter().zip(&step).map(|(a, s)| a + t * s).collect();
            let value = objective(&candidate, examples, with_bias, l2);
            if value >= current + 1e-4 * t * slope {
                theta = candidate;
                current = value;
                improved = true;
                break;
            }
            t *= 0.5;
        }
        let largest = step.iter().fold(0f64, |m, s| m.max((t * s).abs()));
        let scale = theta.iter().fold(1f64, |m, v| m.max(v.abs()));
        if !improved || largest < 1e-7 * scale {
            break;
        }
    }
    Fit {
        theta,
        objective: current,
        iterations,
    }
}

/// Solves `A x = b` for the symmetric positive definite `A` given as its product with a vector.
fn conjugate_gradient(a: &dyn Fn(&[f64]) -> Vec<f64>, b: &[f64]) -> Vec<f64> {
    let mut x = vec![0f64; b.len()];
    let mut r = b.to_vec();
    let mut direction = r.clone();
    let mut rr: f64 = r.iter().map(|v| v * v).sum();
    let tolerance = 1e-20 * rr.max(f64::MIN_POSITIVE);
    for _ in 0..MAX_CG_STEPS {
        if rr <= tolerance {
            break;
        }
        let ad = a(&direction);
        let curvature: f64 = direction.iter().zip(&ad).map(|(d, v)| d * v).sum();
        if curvature <= 0.0 {
            break;
        }
        let alpha = rr / curvature;
        for ((xi, ri), (di, adi)) in x
            .iter_mut()
            .zip(r.iter_mut())
            .zip(direction.iter().zip(&ad))
        {
            *xi += alpha * di;
            *ri -= alpha * adi;
        }
        let next: f64 = r.iter().map(|v| v * v).sum();
        let beta = next / rr;
        rr = next;
        for (di, ri) in direction.iter_mut().zip(&r) {
            *di = ri + beta * *di;
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fit's optimum against independent checks: the objective is lower a little way off in
    /// every direction, and its gradient (central differences) vanishes there.
    #[test]
    fn the_fit_reaches_the_penalised_maximum() {
        let features: Vec<Vec<f32>> = (0..60)
            .map(|i| {
                (0..5)
                    .map(|j| ((i * 7 + j * 3) % 11) as f32 / 5.0 - 1.0)
                    .collect()
            })
            .collect();
        let examples: Vec<Example<'_>> = features
            .iter()
            .enumerate()
            .map(|(i, h)| Example {
                h,
                log_z: 3.0 + (i % 5) as f64 * 0.2,
                positive: if i % 4 == 0 { 1.0 } else { 0.0 },
                events: 1.0 + (i % 3) as f64,
                weight: if i % 4 == 0 { 1.0 } else { 7.0 },
            })
            .collect();
        for with_bias in [false, true] {
            let fit = fit_row(&examples, with_bias, 0.5);
            assert!(fit.iterations < 20, "{}", fit.iterations);
            let best = objective(&fit.theta, &examples, with_bias, 0.5);
            for k in 0..fit.theta.len() {
                for delta in [-1e-3, 1e-3] {
                    let mut moved = fit.theta.clone();
                    moved[k] += delta;
                    assert!(objective(&moved, &examples, with_bias, 0.5) < best);
                }
                let (mut up, mut down) = (fit.theta.clone(), fit.theta.clone());
                up[k] += 1e-5;
                down[k] -= 1e-5;
                let g = (objective(&up, &examples, with_bias, 0.5)
                    - objective(&down, &examples, with_bias, 0.5))
                    / 2e-5;
                assert!(g.abs() < 1e-5, "d/dtheta[{k}] = {g}");
            }
        }
    }

    #[test]
    fn conjugate_gradients_solve_a_known_system() {
        // A = [[4, 2], [2, 3]], b = [2, 1] -> x = [0.5, 0].
        let a = |v: &[f64]| vec![4.0 * v[0] + 2.0 * v[1], 2.0 * v[0] + 3.0 * v[1]];
        let x = conjugate_gradient(&a, &[2.0, 1.0]);
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
    }
}
