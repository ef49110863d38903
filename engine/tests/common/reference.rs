//! Plain f64 re-implementations of SASRec and GRU4Rec, written from the fixtures' inference
//! contract (`tests/fixtures/README` of the shared fixtures: RecBole's `full_sort_predict`) and
//! reading `model.safetensors` directly: every logit of a history, where the fixtures' golden
//! files hold only the top 100. Loops over scalars, no engine code, so they check the engine
//! independently of its kernels.

use std::collections::HashMap;
use std::path::Path;

/// A checkpoint's tensors as f64, with their shapes.
pub struct StateDict(HashMap<String, (Vec<usize>, Vec<f64>)>);

impl StateDict {
    pub fn read(path: &Path) -> StateDict {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut map = HashMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect();
            map.insert(name, (view.shape().to_vec(), values));
        }
        StateDict(map)
    }

    fn get(&self, name: &str) -> &[f64] {
        &self.0.get(name).unwrap_or_else(|| panic!("{name}")).1
    }

    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    fn rows(&self, name: &str) -> usize {
        self.0[name].0[0]
    }

    fn row(&self, name: &str, r: usize) -> &[f64] {
        let (shape, values) = &self.0[name];
        let w = shape[1];
        &values[r * w..(r + 1) * w]
    }
}

/// `x W^T + b` for a PyTorch Linear (`b` absent: zero).
fn linear(sd: &StateDict, weight: &str, bias: Option<&str>, x: &[f64]) -> Vec<f64> {
    let out = sd.rows(weight);
    (0..out)
        .map(|o| {
            let dot: f64 = sd.row(weight, o).iter().zip(x).map(|(w, v)| w * v).sum();
            dot + bias.map_or(0.0, |b| sd.get(b)[o])
        })
        .collect()
}

fn layer_norm(sd: &StateDict, prefix: &str, x: &[f64], eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let (g, b) = (
        sd.get(&format!("{prefix}.weight")),
        sd.get(&format!("{prefix}.bias")),
    );
    x.iter()
        .enumerate()
        .map(|(i, v)| (v - mean) / (var + eps).sqrt() * g[i] + b[i])
        .collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm_erf(x / std::f64::consts::SQRT_2))
}

/// erf to ~1e-16 (series below 3, continued fraction above): the exact GELU's.
fn libm_erf(x: f64) -> f64 {
    if x.abs() < 3.0 {
        // erf x = 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1))
        let mut sum = 0f64;
        let mut term = x;
        let mut n = 0f64;
        while term.abs() > 1e-18 * sum.abs().max(1e-300) || n < 3.0 {
            sum += term / (2.0 * n + 1.0);
            n += 1.0;
            term *= -x * x / n;
            if n > 200.0 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc by Lentz's continued fraction.
        let a = x.abs();
        let mut f = a;
        let (mut c, mut d) = (a, 0.0);
        for k in 1..200 {
            let an = k as f64 / 2.0;
            d = 1.0 / (a + an * d);
            c = a + an / c;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        let erfc = (-a * a).exp() / (f * std::f64::consts::PI.sqrt());
        (1.0 - erfc).copysign(x)
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// SASRec's hidden vector for a history of internal indices (its last `max_len` items).
pub fn sasrec_hidden(sd: &StateDict, history: &[u32], n_heads: usize) -> Vec<f64> {
    let max_len = sd.rows("position_embedding.weight");
    let items = &history[history.len().saturating_sub(max_len)..];
    let t = items.len();
    let mut x: Vec<Vec<f64>> = items
        .iter()
        .enumerate()
        .map(|(slot, &item)| {
            let e = sd.row("item_embedding.weight", item as usize);
            let p = sd.row("position_embedding.weight", slot);
            let sum: Vec<f64> = e.iter().zip(p).map(|(a, b)| a + b).collect();
            layer_norm(sd, "LayerNorm", &sum, 1e-12)
        })
        .collect();
    let layers = (0..)
        .take_while(|l| {
            sd.has(&format!(
                "trm_encoder.layer.{l}.feed_forward.dense_1.weight"
            ))
        })
        .count();
    let h = x[0].len();
    let d = h / n_heads;
    for l in 0..layers {
        let p = format!("trm_encoder.layer.{l}");
        let a = format!("{p}.multi_head_attention");
        let proj = |m: &str, v: &[f64]| {
            linear(
                sd,
                &format!("{a}.{m}.weight"),
                Some(&format!("{a}.{m}.bias")),
                v,
            )
        };
        let q: Vec<Vec<f64>> = x.iter().map(|v| proj("query", v)).collect();
        let k: Vec<Vec<f64>> = x.iter().map(|v| proj("key", v)).collect();
        let vals: Vec<Vec<f64>> = x.iter().map(|v| proj("value", v)).collect();
        let mut next = Vec::with_capacity(t);
        for i in 0..t {
            let mut context = vec![0.0; h];
            for head in 0..n_heads {
                let cols = head * d..(head + 1) * d;
                // Causal: keys 0..=i (RecBole's -10000 elsewhere weighs exactly 0).
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        q[i][cols.clone()]
                            .iter()
                            .zip(&k[j][cols.clone()])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for (j, e) in exps.iter().enumerate() {
                    for c in cols.clone() {
                        context[c] += e / total * vals[j][c];
                    }
                }
            }
            let attended = proj("dense", &context);
            let residual: Vec<f64> = attended.iter().zip(&x[i]).map(|(a, b)| a + b).collect();
            let attended = layer_norm(sd, &format!("{a}.LayerNorm"), &residual, 1e-12);
            let f = format!("{p}.feed_forward");
            let inner: Vec<f64> = linear(
                sd,
                &format!("{f}.dense_1.weight"),
                Some(&format!("{f}.dense_1.bias")),
                &attended,
            )
            .into_iter()
            .map(gelu)
            .collect();
            let out = linear(
                sd,
                &format!("{f}.dense_2.weight"),
                Some(&format!("{f}.dense_2.bias")),
                &inner,
            );
            let residual: Vec<f64> = out.iter().zip(&attended).map(|(a, b)| a + b).collect();
            next.push(layer_norm(sd, &format!("{f}.LayerNorm"), &residual, 1e-12));
        }
        x = next;
    }
    x.pop().expect("at least one item")
}

/// GRU4Rec's hidden vector for a history (its last `max_len` items).
pub fn gru4rec_hidden(sd: &StateDict, history: &[u32], max_len: usize) -> Vec<f64> {
    let items = &history[history.len().saturating_sub(max_len)..];
    let mut inputs: Vec<Vec<f64>> = items
        .iter()
        .map(|&i| sd.row("item_embedding.weight", i as usize).to_vec())
        .collect();
    let layers = (0..)
        .take_while(|l| sd.has(&format!("gru_layers.weight_ih_l{l}")))
        .count();
    let mut state = Vec::new();
    for l in 0..layers {
        let hidden = sd.rows(&format!("gru_layers.weight_hh_l{l}")) / 3;
        let (bih, bhh) = (
            format!("gru_layers.bias_ih_l{l}"),
            format!("gru_layers.bias_hh_l{l}"),
        );
        let (bih, bhh) = (
            sd.has(&bih).then_some(bih.as_str()),
            sd.has(&bhh).then_some(bhh.as_str()),
        );
        state = vec![0.0; hidden];
        let mut outputs = Vec::with_capacity(inputs.len());
        for x in &inputs {
            let gi = linear(sd, &format!("gru_layers.weight_ih_l{l}"), bih, x);
            let gh = linear(sd, &format!("gru_layers.weight_hh_l{l}"), bhh, &state);
            for c in 0..hidden {
                let r = sigmoid(gi[c] + gh[c]);
                let z = sigmoid(gi[hidden + c] + gh[hidden + c]);
                let n = (gi[2 * hidden + c] + r * gh[2 * hidden + c]).tanh();
                state[c] = (1.0 - z) * n + z * state[c];
            }
            outputs.push(state.clone());
        }
        inputs = outputs;
    }
    linear(sd, "dense.weight", Some("dense.bias"), &state)
}

/// Every logit (index 0 included) of a hidden vector: `h . item_embedding[i]`, no bias.
pub fn dot_logits(sd: &StateDict, hidden: &[f64]) -> Vec<f64> {
    (0..sd.rows("item_embedding.weight"))
        .map(|i| {
            sd.row("item_embedding.weight", i)
                .iter()
                .zip(hidden)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}
