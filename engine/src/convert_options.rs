//! The options of a conversion as users give them (`recsys convert`, `recsys sweep`, the Python
//! package's `recsys.convert`): their names, defaults and the combinations refused, in one place,
//! so every front end takes the same options to the same engine and refuses the same ones with the
//! same reason, each in its own spelling (`--int8-mode w8a8` or `int8_mode="w8a8"`).

use crate::calibration::CalibrationMethod;
use crate::engine_dir::{Precision, Screen};

/// The layers a W8A8 engine quantizes activations of with calibrated static scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum W8a8Layers {
    /// The output layer; dense layers keep each request's own int16 scale.
    #[default]
    Output,
    /// The output layer and every dense layer's input: what an explicit-quantization (all-layer
    /// Q/DQ) graph computes.
    All,
}

/// How int8 is applied (with precision int8).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Int8Mode {
    /// Weights int8; each request's activations get their own int16 scale (no calibration).
    #[default]
    WeightOnly,
    /// The output layer's input at a calibrated static int8 scale too (every dense layer's scale
    /// is calibrated and recorded, for ONNX exports).
    W8a8,
    /// Every dense layer's input at its calibrated static scale as well: what an
    /// explicit-quantization ONNX/TensorRT graph computes.
    W8a8All,
}

impl Int8Mode {
    pub const ALL: [Int8Mode; 3] = [Int8Mode::WeightOnly, Int8Mode::W8a8, Int8Mode::W8a8All];

    pub fn as_str(self) -> &'static str {
        match self {
            Int8Mode::WeightOnly => "weight-only",
            Int8Mode::W8a8 => "w8a8",
            Int8Mode::W8a8All => "w8a8-all",
        }
    }

    /// Whether activations get calibrated static scales (calibration histories needed).
    pub fn calibrated(self) -> bool {
        self != Int8Mode::WeightOnly
    }
}

impl std::fmt::Display for Int8Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Int8Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Int8Mode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!("unknown int8 mode {s:?} (expected weight-only, w8a8 or w8a8-all)")
            })
    }
}

/// How calibration picks each activation's clipping threshold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CalibrationChoice {
    /// The largest magnitude seen (ONNX Runtime's default).
    Minmax,
    /// A high percentile of the magnitudes (`calibration_percentile`).
    Percentile,
    /// Where the 8-bit histogram loses the least information (KL divergence; TensorRT's default).
    #[default]
    Entropy,
}

impl CalibrationChoice {
    pub const ALL: [CalibrationChoice; 3] = [
        CalibrationChoice::Minmax,
        CalibrationChoice::Percentile,
        CalibrationChoice::Entropy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CalibrationChoice::Minmax => "minmax",
            CalibrationChoice::Percentile => "percentile",
            CalibrationChoice::Entropy => "entropy",
        }
    }
}

impl std::fmt::Display for CalibrationChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CalibrationChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CalibrationChoice::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!("unknown calibration method {s:?} (expected minmax, percentile or entropy)")
            })
    }
}

/// The percentile `CalibrationChoice::Percentile` clips at unless told otherwise.
pub const DEFAULT_CALIBRATION_PERCENTILE: f64 = 99.99;

/// How a front end spells an option in its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spelling {
    /// The command line's: `--int8-mode w8a8`.
    Flags,
    /// Python's keyword arguments (and the Rust fields): `int8_mode="w8a8"`.
    Keywords,
}

impl Spelling {
    /// Option `name` (snake_case), with `value` when given.
    pub fn option(self, name: &str, value: Option<&str>) -> String {
        match (self, value) {
            (Spelling::Flags, None) => format!("--{}", name.replace('_', "-")),
            (Spelling::Flags, Some(v)) => format!("--{} {v}", name.replace('_', "-")),
            (Spelling::Keywords, None) => format!("{name}="),
            (Spelling::Keywords, Some(v)) => format!("{name}={v:?}"),
        }
    }
}

/// A conversion's quantization options, with the defaults every front end shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvertOptions {
    pub precision: Precision,
    pub int8_mode: Int8Mode,
    pub screen: Screen,
    /// Whether calibration histories were given.
    pub calibration: bool,
    pub calibration_method: CalibrationChoice,
    pub calibration_percentile: f64,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            precision: Precision::Fp32,
            int8_mode: Int8Mode::WeightOnly,
            screen: Screen::None,
            calibration: false,
            calibration_method: CalibrationChoice::default(),
            calibration_percentile: DEFAULT_CALIBRATION_PERCENTILE,
        }
    }
}

/// What a valid set of options asks of the conversion.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvertPlan {
    pub precision: Precision,
    pub screen: Screen,
    /// The method to calibrate with, when the options need calibration histories.
    pub calibration: Option<CalibrationMethod>,
    pub w8a8_layers: W8a8Layers,
}

impl ConvertOptions {
    /// The plan, or the reason these options do not go together, naming them in `spelling`.
    pub fn plan(&self, spelling: Spelling) -> Result<ConvertPlan, String> {
        let opt = |name: &str, value: &str| spelling.option(name, Some(value));
        let precision = self.precision.as_str();
        let mode = self.int8_mode.as_str();
        if self.int8_mode.calibrated() && self.precision != Precision::Int8 {
            return Err(format!(
                "{} needs {} (it is {})",
                opt("int8_mode", mode),
                opt("precision", "int8"),
                opt("precision", precision),
            ));
        }
        if self.int8_mode.calibrated() && !self.calibration {
            return Err(format!(
                "{} needs {} (histories in the predict JSONL format)",
                opt("int8_mode", mode),
                spelling.option("calibration", None),
            ));
        }
        if self.calibration && !self.int8_mode.calibrated() {
            return Err(format!(
                "{} applies to {} with {} or {} only",
                spelling.option("calibration", None),
                opt("precision", "int8"),
                opt("int8_mode", "w8a8"),
                opt("int8_mode", "w8a8-all"),
            ));
        }
        if self.screen == Screen::Int8 && self.precision == Precision::Bf16 {
            return Err(format!(
                "{} screens fp32 and fp16 engines; a bf16 engine rounds its activations to \
                 bf16, which the screen's bounds do not cover (use {} or {} with the screen)",
                opt("screen", "int8"),
                opt("precision", "fp32"),
                opt("precision", "fp16"),
            ));
        }
        if self.screen == Screen::Int8 && self.precision == Precision::Int8 {
            return Err(format!(
                "{} screens fp32 and fp16 engines (their answers, at int8 cost); an int8 engine \
                 already scores from int8 weights",
                opt("screen", "int8"),
            ));
        }
        let calibration = if self.int8_mode.calibrated() {
            let method = CalibrationMethod::parse(
                self.calibration_method.as_str(),
                self.calibration_percentile,
            )
            .map_err(|e| format!("{}: {e}", spelling.option("calibration_percentile", None)))?;
            Some(method)
        } else {
            None
        };
        Ok(ConvertPlan {
            precision: self.precision,
            screen: self.screen,
            calibration,
            w8a8_layers: match self.int8_mode {
                Int8Mode::W8a8All => W8a8Layers::All,
                _ => W8a8Layers::Output,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_names_its_options_in_each_spelling() {
        let w8a8_fp32 = ConvertOptions {
            int8_mode: Int8Mode::W8a8,
            calibration: true,
            ..Default::default()
        };
        assert_eq!(
            w8a8_fp32.plan(Spelling::Flags).unwrap_err(),
            "--int8-mode w8a8 needs --precision int8 (it is --precision fp32)"
        );
        assert_eq!(
            w8a8_fp32.plan(Spelling::Keywords).unwrap_err(),
            "int8_mode=\"w8a8\" needs precision=\"int8\" (it is precision=\"fp32\")"
        );
        let uncalibrated = ConvertOptions {
            precision: Precision::Int8,
            int8_mode: Int8Mode::W8a8All,
            ..Default::default()
        };
        assert!(uncalibrated
            .plan(Spelling::Flags)
            .unwrap_err()
            .starts_with("--int8-mode w8a8-all needs --calibration"));
        let stray = ConvertOptions {
            calibration: true,
            ..Default::default()
        };
        assert!(stray
            .plan(Spelling::Keywords)
            .unwrap_err()
            .starts_with("calibration= applies to"));
        let screened_int8 = ConvertOptions {
            precision: Precision::Int8,
            screen: Screen::Int8,
            ..Default::default()
        };
        assert!(screened_int8
            .plan(Spelling::Flags)
            .unwrap_err()
            .starts_with("--screen int8 screens"));
        let bad_percentile = ConvertOptions {
            precision: Precision::Int8,
            int8_mode: Int8Mode::W8a8,
            calibration: true,
            calibration_method: CalibrationChoice::Percentile,
            calibration_percentile: 20.0,
            ..Default::default()
        };
        assert!(bad_percentile
            .plan(Spelling::Flags)
            .unwrap_err()
            .contains("--calibration-percentile"));
    }

    #[test]
    fn valid_options_plan_what_they_say() {
        let plan = ConvertOptions::default().plan(Spelling::Flags).unwrap();
        assert_eq!(
            (plan.precision, plan.screen, plan.calibration),
            (Precision::Fp32, Screen::None, None)
        );
        let plan = ConvertOptions {
            precision: Precision::Int8,
            int8_mode: Int8Mode::W8a8All,
            calibration: true,
            ..Default::default()
        }
        .plan(Spelling::Keywords)
        .unwrap();
        assert_eq!(plan.calibration, Some(CalibrationMethod::Entropy));
        assert_eq!(plan.w8a8_layers, W8a8Layers::All);
        for mode in Int8Mode::ALL {
            assert_eq!(mode.as_str().parse::<Int8Mode>(), Ok(mode));
        }
        for method in CalibrationChoice::ALL {
            assert_eq!(method.as_str().parse::<CalibrationChoice>(), Ok(method));
        }
    }
}
