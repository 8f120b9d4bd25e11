//! A sentencepiece model's `normalizer_spec.precompiled_charsmap` (its NFKC-style rules, e.g.
//! `nmt_nfkc`, compiled): a darts-clone double-array trie over UTF-8 prefixes whose values
//! index NUL-terminated replacements. Written by hand rather than taken from the
//! `spm_precompiled` crate, which `tokenizers` uses: that one takes the shortest rule and works
//! by grapheme cluster, and sentencepiece's `NormalizePrefix` takes the longest rule at each
//! position of the text.

pub struct PrecompiledCharsmap {
    /// The trie's units (darts-clone's 32-bit `DoubleArrayUnit`).
    trie: Vec<u32>,
    /// The replacements, each ending in NUL.
    normalized: Vec<u8>,
}

impl PrecompiledCharsmap {
    /// `<trie bytes: u32 LE><trie units: u32 LE each><replacements>`.
    pub fn parse(blob: &[u8]) -> Result<Self, String> {
        let size = blob
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or("precompiled_charsmap: shorter than its header")?;
        if size % 4 != 0 || 4 + size > blob.len() || size == 0 {
            return Err(format!(
                "precompiled_charsmap: a trie of {size} bytes in a blob of {}",
                blob.len()
            ));
        }
        let trie = blob[4..4 + size]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(PrecompiledCharsmap {
            trie,
            normalized: blob[4 + size..].to_vec(),
        })
    }

    /// The longest rule at the start of `text`: the bytes it consumes and its replacement.
    pub fn longest_prefix(&self, text: &str) -> Option<(usize, &str)> {
        let unit = |pos: usize| self.trie.get(pos).copied();
        let offset = |u: u32| ((u >> 10) << ((u & (1 << 9)) >> 6)) as usize;
        let mut best = None;
        let mut node = offset(unit(0)?);
        for (i, &c) in text.as_bytes().iter().enumerate() {
            if c == 0 {
                break;
            }
            node ^= c as usize;
            let u = unit(node)?;
            // The label: the byte that leads here (and the leaf flag bit 31 clear).
            if u & ((1 << 31) | 0xFF) != c as u32 {
                break;
            }
            node ^= offset(u);
            if (u >> 8) & 1 == 1 {
                let value = (unit(node)? & ((1 << 31) - 1)) as usize;
                best = Some((i + 1, value));
            }
        }
        let (len, at) = best?;
        let end = self.normalized[at..].iter().position(|&b| b == 0)? + at;
        let replacement = std::str::from_utf8(&self.normalized[at..end]).ok()?;
        // A rule ends on a character boundary of well-formed text; one that does not is not
        // applied (sentencepiece's rules are built from whole characters).
        text.is_char_boundary(len).then_some((len, replacement))
    }
}
