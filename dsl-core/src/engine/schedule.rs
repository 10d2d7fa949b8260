//! Learning-rate schedule: linear warmup, then cosine decay to a floor
//! (Megatron-LM's `OptimizerParamScheduler` with `lr_decay_style = cosine`).

/// Linear warmup from 0 to `lr` over `warmup_steps`, then half a cosine from
/// `lr` down to `min_lr` at `total_steps`, and `min_lr` after that.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupCosine {
    /// Peak learning rate, reached at the end of warmup.
    pub lr: f64,
    /// Floor reached at `total_steps`.
    pub min_lr: f64,
    /// Steps of linear warmup (0: start at the peak).
    pub warmup_steps: u64,
    /// Step at which the decay reaches `min_lr`.
    pub total_steps: u64,
}

impl WarmupCosine {
    /// The learning rate of 1-based step `step` (the first update is step 1,
    /// so warmup never takes a step at lr 0).
    pub fn lr_at(&self, step: u64) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps);
        if decay_steps == 0 {
            return self.min_lr;
        }
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + (self.lr - self.min_lr) * cosine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn warmup_then_cosine_values() {
        let s = WarmupCosine {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!(close(s.lr_at(1), 1e-4));
        assert!(close(s.lr_at(5), 5e-4));
        assert!(close(s.lr_at(10), 1e-3));
        // Halfway through the decay the cosine is at its midpoint.
        assert!(close(s.lr_at(60), 0.5 * (1e-3 + 1e-4)));
        // A quarter in: min + (max - min)·(1 + cos(π/4))/2.
        let quarter = 1e-4 + 9e-4 * 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos());
        assert!(close(s.lr_at(35), quarter));
        assert!(close(s.lr_at(110), 1e-4));
        assert!(close(s.lr_at(1000), 1e-4));
        // Monotone: up during warmup, down after.
        let lrs: Vec<f64> = (1..=110).map(|i| s.lr_at(i)).collect();
        assert!(lrs[..10].windows(2).all(|w| w[0] < w[1]));
        assert!(lrs[10..].windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn no_warmup_starts_at_peak() {
        let s = WarmupCosine {
            lr: 2.0,
            min_lr: 0.0,
            warmup_steps: 0,
            total_steps: 4,
        };
        assert!(close(s.lr_at(0), 2.0));
        assert!(close(s.lr_at(2), 1.0));
        assert!(close(s.lr_at(4), 0.0));
    }
}
