//! numpy's legacy `RandomState`: MT19937 seeded by `init_genrand`, and `shuffle` on a 1-D array.
//! Reproduced exactly so that a GPTDataset built here visits samples in the same order as
//! Megatron's for the same data, split and seed.

pub struct RandomState {
    mt: [u32; 624],
    i: usize,
}

impl RandomState {
    /// `numpy.random.RandomState(seed)` for an integer seed below 2^32.
    pub fn new(seed: u32) -> Self {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        RandomState { mt, i: 624 }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        let mix = |a: u32, b: u32, c: u32| {
            let y = (a & UPPER) | (b & LOWER);
            c ^ (y >> 1) ^ if y & 1 != 0 { 0x9908_b0df } else { 0 }
        };
        for k in 0..227 {
            self.mt[k] = mix(self.mt[k], self.mt[k + 1], self.mt[k + 397]);
        }
        for k in 227..623 {
            self.mt[k] = mix(self.mt[k], self.mt[k + 1], self.mt[k - 227]);
        }
        self.mt[623] = mix(self.mt[623], self.mt[0], self.mt[396]);
        self.i = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.i >= 624 {
            self.twist();
        }
        let mut y = self.mt[self.i];
        self.i += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    pub fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        (hi << 32) | self.next_u32() as u64
    }

    /// numpy's `random_interval`: uniform in `[0, max]` by masked rejection.
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        mask |= mask >> 1;
        mask |= mask >> 2;
        mask |= mask >> 4;
        mask |= mask >> 8;
        mask |= mask >> 16;
        mask |= mask >> 32;
        if max <= 0xffff_ffff {
            loop {
                let v = (self.next_u32() as u64) & mask;
                if v <= max {
                    return v;
                }
            }
        } else {
            loop {
                let v = self.next_u64() & mask;
                if v <= max {
                    return v;
                }
            }
        }
    }

    /// `random_sample()` / `random()`: 53 random bits as a double in `[0, 1)`.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }

    /// `geometric(p)` of the legacy `RandomState` for `p < 1/3`: by inversion of one
    /// `random()`, `ceil(log1p(-u) / log(1 - p))`.
    pub fn geometric(&mut self, p: f64) -> i64 {
        assert!(
            p > 0.0 && p < 1.0 / 3.0,
            "geometric: inversion covers p < 1/3"
        );
        let u = self.random();
        ((-u).ln_1p() / (1.0 - p).ln()).ceil() as i64
    }

    /// `randint(low, high)` (one int64 in `[low, high)`, a range below 2^32).
    pub fn randint(&mut self, low: i64, high: i64) -> i64 {
        assert!(high > low, "randint: empty range");
        low + self.random_interval((high - low - 1) as u64) as i64
    }

    /// `choice(len(p), p=p)` for one draw: the cumulative sums of `p` normalized by their last
    /// and searched (side right) with one `random()`.
    pub fn choice_index(&mut self, p: &[f64]) -> usize {
        let mut cdf: Vec<f64> = p
            .iter()
            .scan(0.0, |acc, &x| {
                *acc += x;
                Some(*acc)
            })
            .collect();
        let last = *cdf.last().expect("choice from an empty set");
        cdf.iter_mut().for_each(|c| *c /= last);
        let u = self.random();
        cdf.partition_point(|&c| c <= u)
    }

    /// `RandomState.shuffle` of a 1-D array: Fisher-Yates from the end.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            x.swap(i, j);
        }
    }
}
