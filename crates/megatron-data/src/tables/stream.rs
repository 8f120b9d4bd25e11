//! A sequential random stream over the counter-based generator: table `i` of seed `s` draws
//! from its own key, so tables are generated in any order, on any thread, byte for byte the same.

use megatron_tensor::RngKey;

pub struct Stream {
    key: RngKey,
    next: u64,
}

impl Stream {
    pub fn new(key: RngKey) -> Self {
        Stream { key, next: 0 }
    }

    /// A child stream for one part of the table (so adding draws to one part does not shift
    /// another's).
    pub fn fork(&mut self, part: u64) -> Stream {
        let k = self.key.fold(0x7461_626c_6500_0000 | part).fold(self.next);
        self.next += 1;
        Stream::new(k)
    }

    pub fn bits(&mut self) -> u64 {
        let b = self.key.bits(self.next);
        self.next += 1;
        b
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.bits() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// Uniform integer in [lo, hi] (inclusive).
    pub fn int(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.bits() % (hi - lo + 1) as u64) as usize
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.bits() % n as u64) as usize
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(f64::MIN_POSITIVE);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// Log-uniform in [lo, hi].
    pub fn log_range(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + (hi.ln() - lo.ln()) * self.uniform()).exp()
    }

    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.below(i + 1);
            x.swap(i, j);
        }
    }
}
