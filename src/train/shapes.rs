//! Shapes: a synthetic image-caption data set, generated from a seed with no download,
//! for image-text training (issue 13). Each scene is a small RGB image of two coloured
//! shapes side by side on a black background, and a caption that describes it:
//! `"a small red square left of a large blue circle"`.
//!
//! A *composition* is the pair of (colour, shape) the caption names; a fixed fifth of the
//! compositions never appears in training and makes up the held-out set, so evaluation
//! asks for new combinations of known words, not new words. Sizes and positions are drawn
//! per scene. Everything is a function of the seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// Shape kinds, as the captions name them.
pub const KINDS: [&str; 3] = ["square", "circle", "triangle"];

/// Colours, as the captions name them, and their RGB values in `[0, 1]`.
pub const COLOURS: [(&str, [f32; 3]); 4] = [
    ("red", [1.0, 0.1, 0.1]),
    ("green", [0.1, 0.9, 0.1]),
    ("blue", [0.2, 0.3, 1.0]),
    ("yellow", [1.0, 0.9, 0.1]),
];

/// One shape of a scene.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Index into [`KINDS`].
    pub kind: usize,
    /// Index into [`COLOURS`].
    pub colour: usize,
    /// Large (`true`) or small.
    pub large: bool,
    /// Centre column, in pixels.
    pub x: usize,
    /// Centre row, in pixels.
    pub y: usize,
}

impl Shape {
    /// Half the side (or the radius), in pixels, for an image of `size` pixels.
    pub fn radius(&self, size: usize) -> usize {
        if self.large {
            size * 3 / 16
        } else {
            size / 10
        }
    }

    /// `small red square`.
    pub fn describe(&self) -> String {
        format!(
            "{} {} {}",
            if self.large { "large" } else { "small" },
            COLOURS[self.colour].0,
            KINDS[self.kind]
        )
    }

    /// Whether pixel `(x, y)` lies inside the shape.
    fn covers(&self, x: usize, y: usize, size: usize) -> bool {
        let r = self.radius(size) as f32;
        let (dx, dy) = (x as f32 - self.x as f32, y as f32 - self.y as f32);
        match KINDS[self.kind] {
            "square" => dx.abs() <= r && dy.abs() <= r,
            "circle" => dx * dx + dy * dy <= r * r,
            // Pointing up: as wide as the side at the bottom, a point at the top.
            _ => dy.abs() <= r && dx.abs() <= (dy + r) / 2.0,
        }
    }
}

/// One image and its caption.
#[derive(Debug, Clone, PartialEq)]
pub struct Scene {
    /// The shape on the left, then the one on the right.
    pub shapes: [Shape; 2],
    /// `a small red square left of a large blue circle`.
    pub caption: String,
    /// The image, channels first (`[3, size, size]` flattened), values in `[0, 1]`.
    pub pixels: Vec<f32>,
}

/// How many scenes, how large, from which seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapesConfig {
    /// Image side in pixels (at least 16).
    pub size: usize,
    /// Training scenes.
    pub train: usize,
    /// Held-out scenes (compositions never seen in training).
    pub eval: usize,
    /// Everything is drawn from this seed.
    pub seed: u64,
}

/// A generated data set.
#[derive(Debug, Clone, PartialEq)]
pub struct Shapes {
    /// Training scenes.
    pub train: Vec<Scene>,
    /// Held-out scenes, of compositions not in `train`.
    pub eval: Vec<Scene>,
}

/// The (colour, kind) pair of each side of a caption, as one index.
fn composition(shapes: &[Shape; 2]) -> usize {
    let one = |s: &Shape| s.colour * KINDS.len() + s.kind;
    one(&shapes[0]) * KINDS.len() * COLOURS.len() + one(&shapes[1])
}

/// Whether a composition is held out: every fifth, which spreads them over all colours
/// and kinds on both sides (29 of the 144).
pub fn held_out(composition: usize) -> bool {
    composition.is_multiple_of(5)
}

/// Generates the data set: `cfg.train` scenes of the training compositions and
/// `cfg.eval` of the held-out ones.
pub fn generate(cfg: &ShapesConfig) -> Result<Shapes> {
    if cfg.size < 16 {
        return Err(Error::InvalidConfig {
            field: "shapes.size",
            value: cfg.size.to_string(),
            reason: "images need at least 16 pixels a side to draw two shapes apart",
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut draw = |held: bool, count: usize| -> Vec<Scene> {
        let mut scenes = Vec::with_capacity(count);
        while scenes.len() < count {
            let scene = scene(&mut rng, cfg.size);
            if held_out(composition(&scene.shapes)) == held {
                scenes.push(scene);
            }
        }
        scenes
    };
    let train = draw(false, cfg.train);
    let eval = draw(true, cfg.eval);
    Ok(Shapes { train, eval })
}

/// One random scene: two shapes, one in each half, at random heights and sizes.
fn scene(rng: &mut ChaCha8Rng, size: usize) -> Scene {
    let mut shape = |half: usize| {
        let large = rng.random_bool(0.5);
        let mut s = Shape {
            kind: rng.random_range(0..KINDS.len()),
            colour: rng.random_range(0..COLOURS.len()),
            large,
            x: 0,
            y: 0,
        };
        let r = s.radius(size);
        // The shape stays a pixel clear of the image's edge and of the middle column.
        let (lo, hi) = (half * size / 2 + r + 1, (half + 1) * size / 2 - r - 2);
        s.x = rng.random_range(lo..=hi.max(lo));
        s.y = rng.random_range(r + 1..=(size - r - 2).max(r + 1));
        s
    };
    let shapes = [shape(0), shape(1)];
    let caption = format!(
        "a {} left of a {}",
        shapes[0].describe(),
        shapes[1].describe()
    );
    let mut pixels = vec![0f32; 3 * size * size];
    for s in &shapes {
        let rgb = COLOURS[s.colour].1;
        for y in 0..size {
            for x in 0..size {
                if s.covers(x, y, size) {
                    for (c, v) in rgb.iter().enumerate() {
                        pixels[(c * size + y) * size + x] = *v;
                    }
                }
            }
        }
    }
    Scene {
        shapes,
        caption,
        pixels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> Shapes {
        generate(&ShapesConfig {
            size: 32,
            train: 300,
            eval: 60,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn the_same_seed_gives_the_same_scenes_and_another_seed_others() {
        assert_eq!(small(7), small(7));
        assert_ne!(small(7).train[0], small(8).train[0]);
    }

    #[test]
    fn captions_describe_their_images() {
        let data = small(3);
        let size = 32;
        for scene in data.train.iter().chain(&data.eval) {
            let [left, right] = scene.shapes;
            assert!(left.x + left.radius(size) < size / 2 - 1);
            assert!(right.x > size / 2 + right.radius(size));
            for s in &scene.shapes {
                // The shape's centre has its colour.
                let rgb: Vec<f32> = (0..3)
                    .map(|c| scene.pixels[(c * size + s.y) * size + s.x])
                    .collect();
                assert_eq!(rgb, COLOURS[s.colour].1, "{}", scene.caption);
                assert!(scene.caption.contains(&s.describe()));
            }
            assert!(scene
                .caption
                .starts_with(&format!("a {} left of", left.describe())));
            // The corners are background.
            assert_eq!(scene.pixels[0], 0.0);
            assert_eq!(scene.pixels[size * size - 1], 0.0);
        }
    }

    #[test]
    fn held_out_compositions_never_appear_in_training() {
        let data = small(5);
        let all = KINDS.len() * COLOURS.len();
        let held = (0..all * all).filter(|&c| held_out(c)).count();
        assert_eq!((held, all * all), (29, 144));
        assert!(data.train.iter().all(|s| !held_out(composition(&s.shapes))));
        assert!(data.eval.iter().all(|s| held_out(composition(&s.shapes))));
        // Every word of the held-out captions is seen in training.
        let words: std::collections::HashSet<&str> = data
            .train
            .iter()
            .flat_map(|s| s.caption.split(' '))
            .collect();
        for s in &data.eval {
            assert!(
                s.caption.split(' ').all(|w| words.contains(w)),
                "{}",
                s.caption
            );
        }
    }

    #[test]
    fn images_too_small_for_two_shapes_are_refused() {
        let cfg = ShapesConfig {
            size: 8,
            train: 1,
            eval: 1,
            seed: 0,
        };
        assert!(matches!(generate(&cfg), Err(Error::InvalidConfig { .. })));
    }
}
