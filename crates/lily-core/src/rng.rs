//! Small deterministic generators. Synthetic weights use a counter-based hash (any element can
//! be produced independently, in parallel, on any device, with the same result); sampling uses
//! a sequential stream seeded from the request.

/// The splitmix64 finaliser: a bijective mix with good avalanche, cheap on CPU and GPU alike.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stable 64-bit key for a string (FNV-1a, then mixed).
pub fn key_of(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// Element `index` of the stream `key`, uniform in [-1, 1).
pub fn uniform_at(key: u64, index: u64) -> f32 {
    let bits = mix64(key ^ mix64(index.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    // 24 high bits give every representable step of an f32 in [0, 1).
    ((bits >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A sequential generator (splitmix64) for sampling.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}
