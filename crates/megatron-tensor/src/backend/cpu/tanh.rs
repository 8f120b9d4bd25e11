//! tanh and its gradient (BERT's pooler: `tanh(W h_[CLS] + b)`).

pub fn tanh_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = x.tanh();
    }
}

/// `dinp = dout * (1 - out²)`, from the forward's output.
pub fn tanh_backward(dinp: &mut [f32], dout: &[f32], out: &[f32]) {
    for ((d, &g), &y) in dinp.iter_mut().zip(dout).zip(out) {
        *d = g * (1.0 - y * y);
    }
}
