//! One panel of a plot: a frame, "nice" ticks with labels, grid lines, and line series.

use super::canvas::{Canvas, Rgb, BLACK, GREY};

pub struct Series {
    pub name: String,
    pub color: Rgb,
    pub points: Vec<(f64, f64)>,
    /// Drawn thin with a dot at each point (validation curves beside training curves).
    pub markers: bool,
}

pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// Tick positions covering [lo, hi]: steps of 1, 2 or 5 times a power of ten, about 5 of them.
pub fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return vec![lo];
    }
    let raw = (hi - lo) / 5.0;
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p);
    let first = (lo / step).ceil() * step;
    (0..)
        .map(|i| first + i as f64 * step)
        .take_while(|v| *v <= hi + step * 1e-9)
        .collect()
}

/// A short tick label: 1.5k, 2M, 0.25, 3e-4.
pub fn label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e9 {
        format!("{}G", trim(v / 1e9))
    } else if a >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if a >= 1e4 {
        format!("{}k", trim(v / 1e3))
    } else if a >= 0.01 {
        trim(v)
    } else {
        format!("{v:.0e}")
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

impl Panel {
    /// Draws the panel into the rectangle (x, y, w, h) of `c`.
    pub fn draw(&self, c: &mut Canvas, x: f64, y: f64, w: f64, h: f64) {
        c.text(&self.title, x + 60.0, y + 4.0, 18.0, BLACK);
        let (left, top, right, bottom) = (x + 70.0, y + 30.0, x + w - 15.0, y + h - 45.0);
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(px, py) in pts.filter(|p| p.0.is_finite() && p.1.is_finite()) {
            (x0, x1, y0, y1) = (x0.min(px), x1.max(px), y0.min(py), y1.max(py));
        }
        if x0 > x1 {
            c.text("no data", left + 10.0, top + 10.0, 14.0, BLACK);
            return;
        }
        if x1 == x0 {
            x1 = x0 + 1.0;
        }
        let pad = if y1 > y0 {
            0.05 * (y1 - y0)
        } else {
            0.5 * y0.abs().max(1.0)
        };
        (y0, y1) = (y0 - pad, y1 + pad);
        let sx = |v: f64| left + (v - x0) / (x1 - x0) * (right - left);
        let sy = |v: f64| bottom - (v - y0) / (y1 - y0) * (bottom - top);
        for t in nice_ticks(x0, x1) {
            let px = sx(t);
            c.line((px, top), (px, bottom), 1.0, GREY);
            let s = label(t);
            let tw = c.text_width(&s, 13.0);
            c.text(&s, px - tw / 2.0, bottom + 4.0, 13.0, BLACK);
        }
        for t in nice_ticks(y0, y1) {
            let py = sy(t);
            c.line((left, py), (right, py), 1.0, GREY);
            let s = label(t);
            let tw = c.text_width(&s, 13.0);
            c.text(&s, left - tw - 5.0, py - 8.0, 13.0, BLACK);
        }
        for (a, b) in [
            ((left, top), (right, top)),
            ((right, top), (right, bottom)),
            ((right, bottom), (left, bottom)),
            ((left, bottom), (left, top)),
        ] {
            c.line(a, b, 1.0, BLACK);
        }
        let xw = c.text_width(&self.x_label, 14.0);
        c.text(
            &self.x_label,
            (left + right - xw) / 2.0,
            bottom + 22.0,
            14.0,
            BLACK,
        );
        c.vertical_text(&self.y_label, x + 12.0, (top + bottom) / 2.0, 14.0, BLACK);
        for s in &self.series {
            let p: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .map(|&(a, b)| (sx(a), sy(b)))
                .collect();
            let width = if s.markers { 1.0 } else { 2.0 };
            for w in p.windows(2) {
                c.line(w[0], w[1], width, s.color);
            }
            if p.len() == 1 || s.markers {
                for &q in &p {
                    c.line(q, q, 7.0, s.color);
                }
            }
        }
    }
}
