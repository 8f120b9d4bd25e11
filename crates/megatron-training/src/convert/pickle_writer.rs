//! Python pickles written for PyTorch's loaders (protocol 2, the one `torch.save` writes): the
//! objects of a `torch.distributed.checkpoint` directory that Megatron-LM loads. Each object is
//! built the way Python's own pickler builds it: a dataclass or Namespace as `cls.__new__(cls)`
//! (`NEWOBJ`) given its state (`BUILD`), a `torch.Size` or enum member as a call (`REDUCE`).
//! No memo: nothing written here is shared or cyclic.

/// A value to pickle.
#[derive(Clone, Debug)]
pub enum Pickle {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Pickle>),
    Tuple(Vec<Pickle>),
    Dict(Vec<(Pickle, Pickle)>),
    /// A class or function by module and name.
    Global(&'static str, &'static str),
    /// `callable(*args)`.
    Reduce(Box<Pickle>, Vec<Pickle>),
    /// `cls.__new__(cls)` with its state set (`None`: no state).
    New(&'static str, &'static str, Box<Pickle>),
    /// A persistent id (`torch.save`: a storage).
    Persistent(Box<Pickle>),
}

impl Pickle {
    pub fn str(s: impl Into<String>) -> Pickle {
        Pickle::Str(s.into())
    }

    /// A dict with string keys.
    pub fn dict<'a>(entries: impl IntoIterator<Item = (&'a str, Pickle)>) -> Pickle {
        Pickle::Dict(
            entries
                .into_iter()
                .map(|(k, v)| (Pickle::str(k), v))
                .collect(),
        )
    }

    /// `torch.Size(dims)`.
    pub fn size(dims: &[usize]) -> Pickle {
        Pickle::Reduce(
            Box::new(Pickle::Global("torch", "Size")),
            vec![Pickle::Tuple(
                dims.iter().map(|&d| Pickle::Int(d as i64)).collect(),
            )],
        )
    }
}

/// The pickle of `v`, protocol 2.
pub fn pickle(v: &Pickle) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    write(v, &mut out);
    out.push(b'.');
    out
}

fn write(v: &Pickle, out: &mut Vec<u8>) {
    match v {
        Pickle::None => out.push(b'N'),
        Pickle::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Pickle::Int(i) => {
            if (0..256).contains(i) {
                out.extend([b'K', *i as u8]);
            } else if (0..65536).contains(i) {
                out.push(b'M');
                out.extend_from_slice(&(*i as u16).to_le_bytes());
            } else if i32::try_from(*i).is_ok() {
                out.push(b'J');
                out.extend_from_slice(&(*i as i32).to_le_bytes());
            } else {
                out.extend([0x8a, 8]);
                out.extend_from_slice(&i.to_le_bytes());
            }
        }
        Pickle::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Pickle::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Pickle::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                items.iter().for_each(|x| write(x, out));
                out.push(b'e');
            }
        }
        Pickle::Tuple(items) => match items.len() {
            0 => out.push(b')'),
            1..=3 => {
                items.iter().for_each(|x| write(x, out));
                out.push(0x84 + items.len() as u8);
            }
            _ => {
                out.push(b'(');
                items.iter().for_each(|x| write(x, out));
                out.push(b't');
            }
        },
        Pickle::Dict(entries) => {
            out.push(b'}');
            if !entries.is_empty() {
                out.push(b'(');
                for (k, x) in entries {
                    write(k, out);
                    write(x, out);
                }
                out.push(b'u');
            }
        }
        Pickle::Global(module, name) => {
            out.push(b'c');
            out.extend_from_slice(module.as_bytes());
            out.push(b'\n');
            out.extend_from_slice(name.as_bytes());
            out.push(b'\n');
        }
        Pickle::Reduce(callable, args) => {
            write(callable, out);
            write(&Pickle::Tuple(args.clone()), out);
            out.push(b'R');
        }
        Pickle::New(module, name, state) => {
            write(&Pickle::Global(module, name), out);
            out.extend([b')', 0x81]);
            if !matches!(state.as_ref(), Pickle::None) {
                write(state, out);
                out.push(b'b');
            }
        }
        Pickle::Persistent(pid) => {
            write(pid, out);
            out.push(b'Q');
        }
    }
}
