//! Whether an engine's AMX-capable layers run on AMX tiles or on the SIMD tables, per batch
//! size: a bf16 engine's output layer scan and dense layers ([`recsys_kernels::fused_amx`],
//! [`recsys_kernels::dense_amx`]), an int8 or W8A8 engine's output layer scan, or a screened
//! engine's int8 screen ([`recsys_kernels::fused_amx_i8`]). Tiles multiply a whole block of rows by items per few
//! dozen cycles but pay a fixed cost per block (loading the tiles, comparing the block with each
//! row's bar), so where they win depends on the batch, the hidden size and the CPU: measured,
//! never assumed.

use crate::plan::{decision_for, describe_choices, PlanSource, Timing};

/// How the AMX choice is made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AmxPolicy {
    /// By measurement on this CPU (or its cached plan).
    #[default]
    Auto,
    /// Tiles at every batch size, where this process can run them.
    On,
    /// Never tiles.
    Off,
}

impl std::str::FromStr for AmxPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(AmxPolicy::Auto),
            "on" => Ok(AmxPolicy::On),
            "off" => Ok(AmxPolicy::Off),
            _ => Err(format!(
                "amx must be \"auto\", \"on\" or \"off\", found {s:?}"
            )),
        }
    }
}

/// What an AMX plan puts on tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxSubject {
    /// A bf16 engine's output layer scan and dense layers.
    Bf16Layers,
    /// An int8 or W8A8 engine's output layer scan (the same scores to the bit either way).
    Int8Output,
    /// A screened engine's int8 screen (its answers exact either way).
    Int8Screen,
}

impl AmxSubject {
    fn describe(self) -> &'static str {
        match self {
            AmxSubject::Bf16Layers => "bf16 layers",
            AmxSubject::Int8Output => "int8 output layer",
            AmxSubject::Int8Screen => "int8 screen",
        }
    }
}

/// Per batch size, whether the plan's subject runs on AMX tiles.
#[derive(Clone, Debug, PartialEq)]
pub struct AmxPlan {
    pub subject: AmxSubject,
    /// `(smallest batch, tiles?)`, ascending.
    pub by_batch: Vec<(usize, bool)>,
    /// Whole calls per batch size: candidate = tiles, fallback = the SIMD tables.
    pub timings: Vec<Timing>,
    pub source: PlanSource,
}

impl AmxPlan {
    /// One choice for every batch size.
    pub fn fixed(subject: AmxSubject, tiles: bool, source: PlanSource) -> Self {
        AmxPlan {
            subject,
            by_batch: vec![(1, tiles)],
            timings: Vec::new(),
            source,
        }
    }

    /// Per batch size, tiles only where they measured strictly faster: a tie keeps the SIMD
    /// tables, whose bf16 scores every other CPU computes alike.
    pub fn from_timings(subject: AmxSubject, timings: Vec<Timing>, source: PlanSource) -> Self {
        AmxPlan {
            subject,
            by_batch: timings
                .iter()
                .map(|t| (t.batch, t.candidate_s < t.fallback_s))
                .collect(),
            timings,
            source,
        }
    }

    /// Whether a batch of `batch` rows runs on tiles (the decision of the largest measured batch
    /// size not above it).
    pub fn tiles_for(&self, batch: usize) -> bool {
        decision_for(&self.by_batch, batch).unwrap_or(false)
    }

    /// Whether some batch size runs on tiles.
    pub fn uses_tiles(&self) -> bool {
        self.by_batch.iter().any(|&(_, tiles)| tiles)
    }

    /// One line for logs: the choice per batch size, the times behind it, where it came from.
    pub fn describe(&self) -> String {
        let choices = describe_choices(
            &self.by_batch,
            &self.timings,
            ["AMX tiles", "SIMD tables"],
            ["tiles", "SIMD"],
        );
        format!(
            "{} {choices} — {}",
            self.subject.describe(),
            self.source.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(batch: usize, candidate_s: f64, fallback_s: f64) -> Timing {
        Timing {
            batch,
            candidate_s,
            fallback_s,
        }
    }

    #[test]
    fn tiles_run_only_where_they_measured_faster() {
        let plan = AmxPlan::from_timings(
            AmxSubject::Bf16Layers,
            vec![
                timing(1, 2e-3, 1e-3),
                timing(8, 1e-3, 1e-3),
                timing(64, 1e-3, 3e-3),
            ],
            PlanSource::Skipped,
        );
        assert!(!plan.tiles_for(1));
        assert!(!plan.tiles_for(8), "a tie keeps the SIMD tables");
        assert!(!plan.tiles_for(63));
        assert!(plan.tiles_for(64) && plan.tiles_for(500));
        assert!(plan.uses_tiles());
        let line = plan.describe();
        assert!(
            line.contains("batch 64+: AMX tiles (1.000 ms tiles, 3.000 ms SIMD)"),
            "{line}"
        );
        assert!(line.contains("batch 1+: SIMD tables"), "{line}");
        assert!(line.starts_with("bf16 layers "), "{line}");
        let screen = AmxPlan::fixed(AmxSubject::Int8Screen, true, PlanSource::Skipped);
        assert!(
            screen.describe().starts_with("int8 screen "),
            "{}",
            screen.describe()
        );
    }

    #[test]
    fn policies_parse_and_typos_are_named() {
        assert_eq!("on".parse::<AmxPolicy>(), Ok(AmxPolicy::On));
        assert_eq!("auto".parse::<AmxPolicy>(), Ok(AmxPolicy::Auto));
        let err = "yes".parse::<AmxPolicy>().unwrap_err();
        assert!(
            err.contains("amx must be") && err.contains("\"yes\""),
            "{err}"
        );
        assert!(!AmxPlan::fixed(AmxSubject::Bf16Layers, false, PlanSource::Skipped).uses_tiles());
    }
}
