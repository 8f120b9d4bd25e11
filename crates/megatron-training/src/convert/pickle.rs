//! Python's pickle, read (never run) into a tree of values, for the files PyTorch and
//! `torch.distributed.checkpoint` write: `torch.save` archives' `data.pkl` and DCP's `.metadata`.
//!
//! Written by hand because what those files are made of is what the pickle crates leave out:
//! serde-pickle drops class names (so a `torch.Size` or a DCP `MetadataIndex` could not be told
//! from a tuple or a dict) and refuses persistent ids, which is how `torch.save` names its
//! tensors' storages. Nothing is imported or called: a class or function is kept as its
//! `module.name`, and an object as the call that would build it plus the state `BUILD` gives it.
//! Objects live in an arena while reading, so an object shared through the memo (filled after
//! it was memoized, as pickle does with dicts and lists) is the same object everywhere.

use std::collections::HashMap;

/// A value read from a pickle.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<PyValue>),
    Tuple(Vec<PyValue>),
    /// Entries in insertion order (keys need not be hashable here).
    Dict(Vec<(PyValue, PyValue)>),
    /// A class or function, by name.
    Global {
        module: String,
        name: String,
    },
    /// What `REDUCE` (`callable(*args)`) or `NEWOBJ` (`cls.__new__(cls, *args)`) builds, with
    /// what `BUILD` gave it and what was appended or set into it (a list or dict subclass).
    Object {
        callable: Box<PyValue>,
        args: Box<PyValue>,
        state: Option<Box<PyValue>>,
        items: Vec<PyValue>,
        entries: Vec<(PyValue, PyValue)>,
    },
    /// A persistent id (`torch.save`: a storage's `('storage', type, key, location, numel)`).
    Persistent(Box<PyValue>),
}

impl PyValue {
    /// `module.name` of a global, or of the callable that built an object.
    pub fn class_name(&self) -> Option<String> {
        match self {
            PyValue::Global { module, name } => Some(format!("{module}.{name}")),
            PyValue::Object { callable, .. } => callable.class_name(),
            _ => None,
        }
    }

    /// A dict's entry under a string key.
    pub fn get(&self, key: &str) -> Option<&PyValue> {
        let entries = match self {
            PyValue::Dict(e) => e,
            PyValue::Object { entries, .. } => entries,
            _ => return None,
        };
        entries
            .iter()
            .find(|(k, _)| matches!(k, PyValue::Str(s) if s == key))
            .map(|(_, v)| v)
    }

    /// An object's attribute: its `BUILD` state's entry (a `__dict__`, or the slots of a
    /// `(dict, slots)` pair).
    pub fn attr(&self, name: &str) -> Option<&PyValue> {
        let PyValue::Object { state: Some(s), .. } = self else {
            return None;
        };
        match s.as_ref() {
            PyValue::Tuple(pair) if pair.len() == 2 => {
                pair[0].get(name).or_else(|| pair[1].get(name))
            }
            other => other.get(name),
        }
    }

    /// The arguments an object was built from.
    pub fn args(&self) -> &[PyValue] {
        match self {
            PyValue::Object { args, .. } => match args.as_ref() {
                PyValue::Tuple(a) => a,
                _ => &[],
            },
            _ => &[],
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            PyValue::Int(i) => Some(*i),
            PyValue::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a list or tuple, or of what `torch.Size((..))` was built from.
    pub fn as_seq(&self) -> Option<&[PyValue]> {
        match self {
            PyValue::List(v) | PyValue::Tuple(v) => Some(v),
            PyValue::Object { .. } if self.class_name().as_deref() == Some("torch.Size") => {
                self.args().first().and_then(|a| a.as_seq())
            }
            _ => None,
        }
    }

    /// A sequence of non-negative integers (a shape, stride or offset).
    pub fn as_usizes(&self) -> Option<Vec<usize>> {
        self.as_seq()?
            .iter()
            .map(|v| v.as_int().and_then(|i| usize::try_from(i).ok()))
            .collect()
    }
}

#[derive(Clone, Debug)]
enum Node {
    Value(PyValue),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Object {
        callable: usize,
        args: usize,
        state: Option<usize>,
        items: Vec<usize>,
        entries: Vec<(usize, usize)>,
    },
    Persistent(usize),
}

#[derive(Clone, Copy)]
enum Slot {
    Mark,
    Id(usize),
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    nodes: Vec<Node>,
    stack: Vec<Slot>,
    memo: HashMap<u64, usize>,
}

/// Reads a pickle (protocols 0-5, the binary opcodes and the text ones Python still writes).
pub fn unpickle(data: &[u8]) -> Result<PyValue, String> {
    let mut m = Machine {
        data,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    let top = m.run()?;
    m.value(top, 0)
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| format!("pickle ends inside an argument at byte {}", self.pos))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64, String> {
        let b = self.take(n)?;
        Ok(b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    fn line(&mut self) -> Result<String, String> {
        let rest = &self.data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("pickle ends inside a text argument")?;
        let s = String::from_utf8_lossy(&rest[..end]).into_owned();
        self.pos += end + 1;
        Ok(s)
    }

    fn add(&mut self, n: Node) -> usize {
        self.nodes.push(n);
        self.nodes.len() - 1
    }

    fn push(&mut self, n: Node) {
        let id = self.add(n);
        self.stack.push(Slot::Id(id));
    }

    fn push_value(&mut self, v: PyValue) {
        self.push(Node::Value(v));
    }

    fn pop(&mut self) -> Result<usize, String> {
        match self.stack.pop() {
            Some(Slot::Id(i)) => Ok(i),
            Some(Slot::Mark) => Err(format!("pickle pops a mark at byte {}", self.pos)),
            None => Err(format!("pickle pops an empty stack at byte {}", self.pos)),
        }
    }

    fn top(&self) -> Result<usize, String> {
        match self.stack.last() {
            Some(Slot::Id(i)) => Ok(*i),
            _ => Err(format!(
                "pickle has no value on the stack at byte {}",
                self.pos
            )),
        }
    }

    /// Everything above the topmost mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<usize>, String> {
        let at = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| format!("pickle has no mark at byte {}", self.pos))?;
        let items = self.stack.split_off(at + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .map(|s| match s {
                Slot::Id(i) => i,
                Slot::Mark => unreachable!("marks above the topmost mark"),
            })
            .collect())
    }

    fn append(&mut self, target: usize, items: Vec<usize>) -> Result<(), String> {
        match &mut self.nodes[target] {
            Node::List(v) => v.extend(items),
            Node::Object { items: v, .. } => v.extend(items),
            _ => return Err(format!("pickle appends to a non-list at byte {}", self.pos)),
        }
        Ok(())
    }

    fn set_items(&mut self, target: usize, kv: Vec<usize>) -> Result<(), String> {
        if !kv.len().is_multiple_of(2) {
            return Err(format!(
                "pickle sets an odd number of items at byte {}",
                self.pos
            ));
        }
        let pairs = kv.chunks_exact(2).map(|c| (c[0], c[1]));
        match &mut self.nodes[target] {
            Node::Dict(v) => v.extend(pairs),
            Node::Object { entries, .. } => entries.extend(pairs),
            _ => {
                return Err(format!(
                    "pickle sets items of a non-dict at byte {}",
                    self.pos
                ))
            }
        }
        Ok(())
    }

    fn global(&mut self, module: String, name: String) {
        self.push_value(PyValue::Global { module, name });
    }

    /// `callable(*args)`: an empty `OrderedDict()` is kept as a dict.
    fn reduce(&mut self, callable: usize, args: usize) {
        let is = |n: &Node, m: &str, c: &str| matches!(n, Node::Value(PyValue::Global { module, name }) if module == m && name == c);
        let empty = matches!(&self.nodes[args], Node::Tuple(a) if a.is_empty());
        if empty && is(&self.nodes[callable], "collections", "OrderedDict") {
            self.push(Node::Dict(Vec::new()));
            return;
        }
        self.push(Node::Object {
            callable,
            args,
            state: None,
            items: Vec::new(),
            entries: Vec::new(),
        });
    }

    fn run(&mut self) -> Result<usize, String> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    self.u8()?;
                }
                0x95 => {
                    self.take(8)?;
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.stack.pop();
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let t = self.top()?;
                    self.stack.push(Slot::Id(t));
                }
                b'N' => self.push_value(PyValue::None),
                0x88 => self.push_value(PyValue::Bool(true)),
                0x89 => self.push_value(PyValue::Bool(false)),
                b'J' => {
                    let v = self.le(4)? as u32 as i32;
                    self.push_value(PyValue::Int(i64::from(v)));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push_value(PyValue::Int(i64::from(v)));
                }
                b'M' => {
                    let v = self.le(2)?;
                    self.push_value(PyValue::Int(v as i64));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        usize::from(self.u8()?)
                    } else {
                        self.le(4)? as usize
                    };
                    let b = self.take(n)?.to_vec();
                    if n > 8 {
                        return Err(format!("pickle integer of {n} bytes at byte {at}"));
                    }
                    let mut v: i64 = 0;
                    for (i, &x) in b.iter().enumerate() {
                        v |= i64::from(x) << (8 * i);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.push_value(PyValue::Int(v));
                }
                b'I' | b'L' => {
                    let s = self.line()?;
                    let t = s.trim_end_matches('L');
                    let v = match t {
                        "01" => PyValue::Bool(true),
                        "00" => PyValue::Bool(false),
                        _ => PyValue::Int(
                            t.parse()
                                .map_err(|_| format!("pickle integer '{s}' at byte {at}"))?,
                        ),
                    };
                    self.push_value(v);
                }
                b'G' => {
                    let v = f64::from_bits(u64::from_be_bytes(
                        self.take(8)?.try_into().expect("8 bytes"),
                    ));
                    self.push_value(PyValue::Float(v));
                }
                b'F' => {
                    let s = self.line()?;
                    let v = s
                        .parse()
                        .map_err(|_| format!("pickle float '{s}' at byte {at}"))?;
                    self.push_value(PyValue::Float(v));
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => self.le(4)?,
                        0x8c => u64::from(self.u8()?),
                        _ => self.le(8)?,
                    } as usize;
                    let s = String::from_utf8(self.take(n)?.to_vec())
                        .map_err(|_| format!("pickle string is not UTF-8 at byte {at}"))?;
                    self.push_value(PyValue::Str(s));
                }
                b'T' | b'U' | b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'T' | b'B' => self.le(4)?,
                        b'U' | b'C' => u64::from(self.u8()?),
                        _ => self.le(8)?,
                    } as usize;
                    let b = self.take(n)?.to_vec();
                    self.push_value(PyValue::Bytes(b));
                }
                b']' => self.push(Node::List(Vec::new())),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items));
                }
                b'a' => {
                    let v = self.pop()?;
                    let t = self.top()?;
                    self.append(t, vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let t = self.top()?;
                    self.append(t, items)?;
                }
                b')' => self.push(Node::Tuple(Vec::new())),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Node::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Node::Tuple(items));
                }
                b'}' => self.push(Node::Dict(Vec::new())),
                b'd' => {
                    let kv = self.pop_mark()?;
                    self.push(Node::Dict(Vec::new()));
                    let t = self.top()?;
                    self.set_items(t, kv)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let t = self.top()?;
                    self.set_items(t, vec![k, v])?;
                }
                b'u' => {
                    let kv = self.pop_mark()?;
                    let t = self.top()?;
                    self.set_items(t, kv)?;
                }
                // Sets are kept as lists.
                0x8f => self.push(Node::List(Vec::new())),
                0x90 => {
                    let items = self.pop_mark()?;
                    let t = self.top()?;
                    self.append(t, items)?;
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items));
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module, name);
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let text = |n: &Node| match n {
                        Node::Value(PyValue::Str(s)) => Ok(s.clone()),
                        _ => Err(format!("pickle global name is not a string at byte {at}")),
                    };
                    let (module, name) = (text(&self.nodes[module])?, text(&self.nodes[name])?);
                    self.global(module, name);
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.reduce(callable, args);
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    self.reduce(cls, args);
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    self.reduce(cls, args);
                }
                b'b' => {
                    let state = self.pop()?;
                    let t = self.top()?;
                    match &mut self.nodes[t] {
                        Node::Object { state: s, .. } => *s = Some(state),
                        // A dict subclass kept as a dict (an `OrderedDict`): its state is
                        // attributes (a state dict's `_metadata`), not items.
                        Node::Dict(_) => {}
                        _ => return Err(format!("pickle builds a non-object at byte {at}")),
                    }
                }
                b'p' => {
                    let k: u64 = self
                        .line()?
                        .parse()
                        .map_err(|_| format!("pickle memo key at byte {at}"))?;
                    let t = self.top()?;
                    self.memo.insert(k, t);
                }
                b'q' | b'r' | 0x94 => {
                    let k = match op {
                        b'q' => u64::from(self.u8()?),
                        b'r' => self.le(4)?,
                        _ => self.memo.len() as u64,
                    };
                    let t = self.top()?;
                    self.memo.insert(k, t);
                }
                b'g' | b'h' | b'j' => {
                    let k = match op {
                        b'g' => self
                            .line()?
                            .parse()
                            .map_err(|_| format!("pickle memo key at byte {at}"))?,
                        b'h' => u64::from(self.u8()?),
                        _ => self.le(4)?,
                    };
                    let id = *self.memo.get(&k).ok_or_else(|| {
                        format!("pickle reads memo {k}, never stored, at byte {at}")
                    })?;
                    self.stack.push(Slot::Id(id));
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Node::Persistent(pid));
                }
                b'P' => {
                    let s = self.line()?;
                    let pid = self.add(Node::Value(PyValue::Str(s)));
                    self.push(Node::Persistent(pid));
                }
                other => {
                    return Err(format!(
                        "pickle opcode 0x{other:02x} at byte {at} is not one this reader knows"
                    ))
                }
            }
        }
    }

    /// The tree under node `id` (shared nodes copied; a cycle is an error).
    fn value(&self, id: usize, depth: usize) -> Result<PyValue, String> {
        if depth > 256 {
            return Err("pickle nests deeper than 256 levels (a cycle?)".into());
        }
        let v = |i: usize| self.value(i, depth + 1);
        let all = |ids: &[usize]| ids.iter().map(|&i| v(i)).collect::<Result<Vec<_>, _>>();
        let pairs = |kv: &[(usize, usize)]| {
            kv.iter()
                .map(|&(k, x)| Ok((v(k)?, v(x)?)))
                .collect::<Result<Vec<_>, String>>()
        };
        Ok(match &self.nodes[id] {
            Node::Value(x) => x.clone(),
            Node::List(items) => PyValue::List(all(items)?),
            Node::Tuple(items) => PyValue::Tuple(all(items)?),
            Node::Dict(kv) => PyValue::Dict(pairs(kv)?),
            Node::Object {
                callable,
                args,
                state,
                items,
                entries,
            } => PyValue::Object {
                callable: Box::new(v(*callable)?),
                args: Box::new(v(*args)?),
                state: state.map(v).transpose()?.map(Box::new),
                items: all(items)?,
                entries: pairs(entries)?,
            },
            Node::Persistent(pid) => PyValue::Persistent(Box::new(v(*pid)?)),
        })
    }
}
