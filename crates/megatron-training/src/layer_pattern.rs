//! Megatron's per-layer pattern flags (`--window-attn-skip-freq`) and `--window-size`'s tuple,
//! parsed once into typed settings. Megatron `eval`s a Python list expression; this reads the
//! same small language by hand (`N`, `[1,0,1]`, `+` and `* k`, parentheses), since no crate
//! parses Python list arithmetic.

use megatron_core::transformer::config::LayerPattern;

/// `N` (every `N`th layer, 1-based) or a list expression such as `"([1]*3+[0])*2"`.
pub fn parse_layer_pattern(flag: &str, text: &str) -> Result<LayerPattern, String> {
    let s: Vec<char> = text.chars().filter(|c| !c.is_whitespace()).collect();
    let bad = |why: &str| format!("{flag} '{text}': {why}");
    if !s.contains(&'[') {
        return match text.trim().parse::<usize>() {
            Ok(0) | Err(_) => Err(bad(
                "expected a positive integer or a list such as [1,1,0]*2",
            )),
            Ok(n) => Ok(LayerPattern::Every(n)),
        };
    }
    let mut p = Parser { s: &s, at: 0 };
    let v = p.sum().map_err(|e| bad(&e))?;
    if p.at != s.len() {
        return Err(bad(&format!("unexpected '{}'", s[p.at])));
    }
    v.iter()
        .map(|&x| match x {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(bad(&format!("entries are 0 or 1, got {other}"))),
        })
        .collect::<Result<Vec<bool>, String>>()
        .map(LayerPattern::List)
}

/// `--window-size (L,R)` (or `L,R`): the keys before a query that a windowed layer sees.
/// `L = -1` (infinite) is full attention (`None`). A causal decoder sees no later keys, so `R`
/// is 0 (or -1, which Transformer Engine reads as 0 under a causal mask).
pub fn parse_window_size(text: &str) -> Result<Option<usize>, String> {
    let bad = |why: &str| format!("--window-size '{text}': {why}");
    let inner = text.trim().trim_start_matches('(').trim_end_matches(')');
    let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
    let [l, r] = parts[..] else {
        return Err(bad("expected two integers, (left,right)"));
    };
    let num = |x: &str| {
        x.parse::<i64>()
            .map_err(|_| bad(&format!("'{x}' is not an integer")))
    };
    let (l, r) = (num(l)?, num(r)?);
    if r != 0 && r != -1 {
        return Err(bad(&format!(
            "the right side must be 0 (a causal decoder sees no later tokens), got {r}"
        )));
    }
    match l {
        -1 => Ok(None),
        l if l >= 0 => Ok(Some(l as usize)),
        l => Err(bad(&format!(
            "the left side must be -1 (no window) or at least 0, got {l}"
        ))),
    }
}

struct Parser<'a> {
    s: &'a [char],
    at: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> Result<(), String> {
        if self.peek() == Some(c) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!("expected '{c}' at character {}", self.at + 1))
        }
    }

    /// `product ('+' product)*`: lists concatenated.
    fn sum(&mut self) -> Result<Vec<u64>, String> {
        let mut v = self.product()?;
        while self.peek() == Some('+') {
            self.at += 1;
            v.extend(self.product()?);
        }
        Ok(v)
    }

    /// `atom ('*' count)*`: a list repeated.
    fn product(&mut self) -> Result<Vec<u64>, String> {
        let mut v = self.atom()?;
        while self.peek() == Some('*') {
            self.at += 1;
            let k = self.number()? as usize;
            if k.saturating_mul(v.len()) > 1 << 20 {
                return Err("the pattern is too long".into());
            }
            v = v.repeat(k);
        }
        Ok(v)
    }

    /// `'[' numbers ']'` or `'(' sum ')'`.
    fn atom(&mut self) -> Result<Vec<u64>, String> {
        match self.peek() {
            Some('[') => {
                self.at += 1;
                let mut v = Vec::new();
                if self.peek() != Some(']') {
                    v.push(self.number()?);
                    while self.peek() == Some(',') {
                        self.at += 1;
                        v.push(self.number()?);
                    }
                }
                self.eat(']')?;
                Ok(v)
            }
            Some('(') => {
                self.at += 1;
                let v = self.sum()?;
                self.eat(')')?;
                Ok(v)
            }
            _ => Err(format!("expected '[' or '(' at character {}", self.at + 1)),
        }
    }

    fn number(&mut self) -> Result<u64, String> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        let digits: String = self.s[start..self.at].iter().collect();
        digits
            .parse()
            .map_err(|_| format!("expected a number at character {}", start + 1))
    }
}
