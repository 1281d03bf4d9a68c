//! Where the encoder runs: `"cpu"`, `"cuda"` (GPU 0) or `"cuda:N"`.
//!
//! A CUDA device in a build without the `cuda` feature, or on a machine whose CUDA driver
//! cannot be loaded (cudarc panics there), is [`Error::DeviceUnavailable`], never a panic.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::{Error, Result};

/// A device named in a configuration or on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU (every core candle uses).
    #[default]
    Cpu,
    /// CUDA GPU number `ordinal`.
    Cuda(usize),
}

impl DeviceSpec {
    /// Opens the device.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => open_cuda(ordinal),
        }
    }

    /// Whether this is a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument {
            what: "device",
            value: s.to_string(),
            reason: "expected \"cpu\", \"cuda\" or \"cuda:N\" (N the GPU number)",
        };
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

fn unavailable(device: String, reason: String) -> Error {
    Error::DeviceUnavailable { device, reason }
}

/// Opens GPU `ordinal`. cudarc panics (rather than failing) when the CUDA driver library
/// cannot be loaded; that becomes an error here, without the panic message.
#[cfg(feature = "cuda")]
pub(crate) fn open_cuda(ordinal: usize) -> Result<Device> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| Device::new_cuda(ordinal));
    std::panic::set_hook(hook);
    let name = format!("cuda:{ordinal}");
    match opened {
        Ok(Ok(device)) => Ok(device),
        Ok(Err(e)) => Err(unavailable(name, format!("cannot open GPU {ordinal}: {e}"))),
        Err(_) => Err(unavailable(
            name,
            "the CUDA driver library (libcuda.so) could not be loaded: is this a machine \
             with an NVIDIA GPU and driver?"
                .into(),
        )),
    }
}

/// Without the `cuda` feature there is no GPU to open.
#[cfg(not(feature = "cuda"))]
pub(crate) fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(unavailable(
        format!("cuda:{ordinal}"),
        "this build has no CUDA support: rebuild with `--features cuda`".into(),
    ))
}
