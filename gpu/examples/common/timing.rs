//! Host-side timing shared by the GPU benchmarks.

use std::time::Instant;

/// Median wall time of `run` in milliseconds over `reps` runs after `warmup` untimed ones.
pub fn median_ms(warmup: usize, reps: usize, mut run: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        run();
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
