//! An RGB raster with anti-aliased lines and text, written as PNG. Hand-written because
//! plotters 0.3 renders text only through font-kit (fontconfig/freetype at build and run time,
//! which a fresh machine may lack); here text is rasterised by `ab_glyph` from DejaVu Sans
//! embedded by the `dejavu` crate, so a plot needs nothing installed.

use ab_glyph::{Font, FontRef, PxScale, ScaleFont};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rgb(pub u8, pub u8, pub u8);

pub const WHITE: Rgb = Rgb(255, 255, 255);
pub const BLACK: Rgb = Rgb(0, 0, 0);
pub const GREY: Rgb = Rgb(200, 200, 200);

pub struct Canvas {
    pub width: usize,
    pub height: usize,
    pixels: Vec<u8>,
    font: FontRef<'static>,
}

impl Canvas {
    pub fn new(width: usize, height: usize) -> Self {
        Canvas {
            width,
            height,
            pixels: vec![255; width * height * 3],
            font: FontRef::try_from_slice(dejavu::sans::regular())
                .expect("the embedded DejaVu Sans parses"),
        }
    }

    /// Blends `c` over the pixel at (x, y) with coverage `a` in [0, 1].
    fn blend(&mut self, x: i64, y: i64, c: Rgb, a: f32) {
        if x < 0 || y < 0 || x >= self.width as i64 || y >= self.height as i64 || a <= 0.0 {
            return;
        }
        let i = (y as usize * self.width + x as usize) * 3;
        let a = a.min(1.0);
        for (k, v) in [c.0, c.1, c.2].into_iter().enumerate() {
            let old = self.pixels[i + k] as f32;
            self.pixels[i + k] = (old + (v as f32 - old) * a).round() as u8;
        }
    }

    pub fn fill_rect(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, c: Rgb) {
        for y in y0.round() as i64..y1.round() as i64 {
            for x in x0.round() as i64..x1.round() as i64 {
                self.blend(x, y, c, 1.0);
            }
        }
    }

    /// A line of `width` pixels: coverage from each pixel's distance to the segment.
    pub fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), width: f64, c: Rgb) {
        let r = width / 2.0;
        let (lo_x, hi_x) = (x0.min(x1) - r - 1.0, x0.max(x1) + r + 1.0);
        let (lo_y, hi_y) = (y0.min(y1) - r - 1.0, y0.max(y1) + r + 1.0);
        let (dx, dy) = (x1 - x0, y1 - y0);
        let len2 = dx * dx + dy * dy;
        for y in lo_y.floor() as i64..=hi_y.ceil() as i64 {
            for x in lo_x.floor() as i64..=hi_x.ceil() as i64 {
                let (px, py) = (x as f64 + 0.5, y as f64 + 0.5);
                let t = if len2 > 0.0 {
                    (((px - x0) * dx + (py - y0) * dy) / len2).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let (qx, qy) = (x0 + t * dx - px, y0 + t * dy - py);
                let d = (qx * qx + qy * qy).sqrt();
                self.blend(x, y, c, (r + 0.5 - d).clamp(0.0, 1.0) as f32);
            }
        }
    }

    /// Width in pixels of `s` at `size` px.
    pub fn text_width(&self, s: &str, size: f32) -> f64 {
        let f = self.font.as_scaled(PxScale::from(size));
        s.chars().map(|ch| f.h_advance(f.glyph_id(ch)) as f64).sum()
    }

    /// Draws `s` with its top-left corner at (x, y).
    pub fn text(&mut self, s: &str, x: f64, y: f64, size: f32, c: Rgb) {
        let scale = PxScale::from(size);
        let scaled = self.font.as_scaled(scale);
        let ascent = scaled.ascent();
        let mut pen = x as f32;
        let mut glyphs = Vec::new();
        for ch in s.chars() {
            let id = scaled.glyph_id(ch);
            glyphs.push(id.with_scale_and_position(scale, ab_glyph::point(pen, y as f32 + ascent)));
            pen += scaled.h_advance(id);
        }
        for g in glyphs {
            if let Some(o) = self.font.outline_glyph(g) {
                let b = o.px_bounds();
                let mut cov = Vec::new();
                o.draw(|gx, gy, a| cov.push((gx, gy, a)));
                for (gx, gy, a) in cov {
                    self.blend(b.min.x as i64 + gx as i64, b.min.y as i64 + gy as i64, c, a);
                }
            }
        }
    }

    /// Text rotated a quarter turn anticlockwise (a y-axis title), its centre at (x, y).
    pub fn vertical_text(&mut self, s: &str, x: f64, y: f64, size: f32, c: Rgb) {
        let w = self.text_width(s, size).ceil() as usize + 2;
        let h = size.ceil() as usize + 4;
        let mut tmp = Canvas {
            width: w,
            height: h,
            pixels: vec![255; w * h * 3],
            font: self.font.clone(),
        };
        tmp.text(s, 1.0, 0.0, size, BLACK);
        for ty in 0..h {
            for tx in 0..w {
                let i = (ty * w + tx) * 3;
                let a = 1.0 - tmp.pixels[i] as f32 / 255.0;
                // (tx, ty) -> (ty, w - 1 - tx): anticlockwise.
                let (ox, oy) = (ty as f64, (w - 1 - tx) as f64);
                self.blend(
                    (x - h as f64 / 2.0 + ox) as i64,
                    (y - w as f64 / 2.0 + oy) as i64,
                    c,
                    a,
                );
            }
        }
    }

    pub fn save_png(&self, path: &std::path::Path) -> std::io::Result<()> {
        let file = std::io::BufWriter::new(std::fs::File::create(path)?);
        let mut enc = png::Encoder::new(file, self.width as u32, self.height as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(std::io::Error::other)?;
        w.write_image_data(&self.pixels)
            .map_err(std::io::Error::other)?;
        w.finish().map_err(std::io::Error::other)
    }
}
