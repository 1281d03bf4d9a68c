//! Solids: a synthetic volume-caption data set, generated from a seed with no download,
//! for volume-text training (the 3-D counterpart of [`super::shapes`]). Each scene is a
//! one-channel volume (intensities in `[0, 1]`, as a scan's) holding two solids, one in
//! the front half of the depth axis and one in the back half, and a caption that
//! describes it: `"a small bright cube in front of a large dim sphere"`.
//!
//! A *composition* is the pair of (intensity, solid) the caption names; a fixed fifth of
//! the compositions never appears in training and makes up the held-out set. Sizes and
//! positions are drawn per scene. Everything is a function of the seed. Which solid is
//! in front is told by depth alone, which no 2-D projection along that axis shows.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// Solid kinds, as the captions name them.
pub const KINDS: [&str; 4] = ["cube", "sphere", "cylinder", "cone"];

/// Intensities, as the captions name them, and their values.
pub const INTENSITIES: [(&str, f32); 2] = [("bright", 1.0), ("dim", 0.45)];

/// One solid of a scene.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Solid {
    /// Index into [`KINDS`].
    pub kind: usize,
    /// Index into [`INTENSITIES`].
    pub intensity: usize,
    /// Large (`true`) or small.
    pub large: bool,
    /// Centre (depth, row, column), in voxels.
    pub centre: [usize; 3],
}

impl Solid {
    /// Half the side (or the radius), in voxels, for a volume of `size` voxels a side.
    pub fn radius(&self, size: usize) -> usize {
        if self.large {
            size * 3 / 16
        } else {
            size / 10
        }
    }

    /// `small bright cube`.
    pub fn describe(&self) -> String {
        format!(
            "{} {} {}",
            if self.large { "large" } else { "small" },
            INTENSITIES[self.intensity].0,
            KINDS[self.kind]
        )
    }

    /// Whether voxel `(z, y, x)` lies inside the solid (cylinders and cones stand upright:
    /// their axis is the row axis, a cone's point at the top).
    fn covers(&self, z: usize, y: usize, x: usize, size: usize) -> bool {
        let r = self.radius(size) as f32;
        let [cz, cy, cx] = self.centre.map(|c| c as f32);
        let (dz, dy, dx) = (z as f32 - cz, y as f32 - cy, x as f32 - cx);
        let across = (dz * dz + dx * dx).sqrt();
        match KINDS[self.kind] {
            "cube" => dz.abs() <= r && dy.abs() <= r && dx.abs() <= r,
            "sphere" => dz * dz + dy * dy + dx * dx <= r * r,
            "cylinder" => dy.abs() <= r && across <= r,
            _ => dy.abs() <= r && across <= (dy + r) / 2.0,
        }
    }
}

/// One volume and its caption.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeScene {
    /// The solid in front (smaller depth), then the one behind.
    pub solids: [Solid; 2],
    /// `a small bright cube in front of a large dim sphere`.
    pub caption: String,
    /// The volume `[1, size, size, size]` flattened (depth, row, column), values in `[0, 1]`.
    pub voxels: Vec<f32>,
}

/// How many scenes, how large, from which seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumesConfig {
    /// Volume side in voxels (at least 16).
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
pub struct Volumes {
    /// Training scenes.
    pub train: Vec<VolumeScene>,
    /// Held-out scenes, of compositions not in `train`.
    pub eval: Vec<VolumeScene>,
}

/// The (intensity, kind) pair of each solid of a caption, as one index.
fn composition(solids: &[Solid; 2]) -> usize {
    let one = |s: &Solid| s.intensity * KINDS.len() + s.kind;
    one(&solids[0]) * KINDS.len() * INTENSITIES.len() + one(&solids[1])
}

/// Whether a composition is held out: every fifth (13 of the 64).
pub fn held_out(composition: usize) -> bool {
    composition.is_multiple_of(5)
}

/// Generates the data set: `cfg.train` scenes of the training compositions and
/// `cfg.eval` of the held-out ones.
pub fn generate(cfg: &VolumesConfig) -> Result<Volumes> {
    if cfg.size < 16 {
        return Err(Error::InvalidConfig {
            field: "data.volume_size",
            value: cfg.size.to_string(),
            reason: "volumes need at least 16 voxels a side to hold two solids apart",
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut draw = |held: bool, count: usize| -> Vec<VolumeScene> {
        let mut scenes = Vec::with_capacity(count);
        while scenes.len() < count {
            let scene = scene(&mut rng, cfg.size);
            if held_out(composition(&scene.solids)) == held {
                scenes.push(scene);
            }
        }
        scenes
    };
    let train = draw(false, cfg.train);
    let eval = draw(true, cfg.eval);
    Ok(Volumes { train, eval })
}

/// One random scene: two solids, one in each half of the depth, anywhere across.
fn scene(rng: &mut ChaCha8Rng, size: usize) -> VolumeScene {
    let mut solid = |half: usize| {
        let mut s = Solid {
            kind: rng.random_range(0..KINDS.len()),
            intensity: rng.random_range(0..INTENSITIES.len()),
            large: rng.random_bool(0.5),
            centre: [0; 3],
        };
        let r = s.radius(size);
        // Inside the volume and its half of the depth, a voxel clear of the faces and of
        // the middle plane where the side leaves room.
        let (lo, hi) = (half * size / 2 + r + 1, (half + 1) * size / 2 - r - 2);
        let across = |rng: &mut ChaCha8Rng| rng.random_range(r + 1..=(size - r - 2).max(r + 1));
        s.centre = [rng.random_range(lo..=hi.max(lo)), across(rng), across(rng)];
        s
    };
    let solids = [solid(0), solid(1)];
    let caption = format!(
        "a {} in front of a {}",
        solids[0].describe(),
        solids[1].describe()
    );
    let mut voxels = vec![0f32; size * size * size];
    for s in &solids {
        let value = INTENSITIES[s.intensity].1;
        for z in 0..size {
            for y in 0..size {
                for x in 0..size {
                    if s.covers(z, y, x, size) {
                        voxels[(z * size + y) * size + x] = value;
                    }
                }
            }
        }
    }
    VolumeScene {
        solids,
        caption,
        voxels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> Volumes {
        generate(&VolumesConfig {
            size: 16,
            train: 200,
            eval: 40,
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
    fn captions_describe_their_volumes() {
        let data = small(3);
        let size = 16;
        for scene in data.train.iter().chain(&data.eval) {
            let [front, back] = scene.solids;
            // Each solid inside its half of the depth and inside the volume.
            assert!(front.centre[0] + front.radius(size) < size / 2);
            assert!(back.centre[0] - back.radius(size) > size / 2);
            for s in &scene.solids {
                let r = s.radius(size);
                assert!(s.centre.iter().all(|&c| c >= r && c + r < size));
            }
            for s in &scene.solids {
                let [z, y, x] = s.centre;
                assert_eq!(
                    scene.voxels[(z * size + y) * size + x],
                    INTENSITIES[s.intensity].1,
                    "{}",
                    scene.caption
                );
                // Every voxel of the solid has its intensity, and a large solid has more
                // of them than a small one of its kind would.
                let count = scene
                    .voxels
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| s.covers(i / (size * size), i / size % size, i % size, size))
                    .filter(|&(_, &v)| v == INTENSITIES[s.intensity].1)
                    .count();
                assert!(
                    count >= if s.large { 20 } else { 1 },
                    "{}: {count}",
                    scene.caption
                );
            }
            assert_eq!(
                scene.caption,
                format!("a {} in front of a {}", front.describe(), back.describe())
            );
            assert_eq!(scene.voxels[0], 0.0);
            assert_eq!(scene.voxels[size * size * size - 1], 0.0);
        }
    }

    #[test]
    fn held_out_compositions_never_appear_in_training() {
        let data = small(5);
        let all = KINDS.len() * INTENSITIES.len();
        let held = (0..all * all).filter(|&c| held_out(c)).count();
        assert_eq!((held, all * all), (13, 64));
        assert!(data.train.iter().all(|s| !held_out(composition(&s.solids))));
        assert!(data.eval.iter().all(|s| held_out(composition(&s.solids))));
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
    fn volumes_too_small_for_two_solids_are_refused() {
        let cfg = VolumesConfig {
            size: 8,
            train: 1,
            eval: 1,
            seed: 0,
        };
        let err = generate(&cfg).unwrap_err().to_string();
        assert!(err.contains("data.volume_size"), "{err}");
    }
}
