//! The NCCL backend on a machine without a GPU: it must refuse with a clear error (cudarc
//! panics when the CUDA driver cannot be loaded; the backend turns that into an error).
//! On a machine with a GPU, a world of one must gather and reduce on the device.
#![cfg(feature = "nccl")]

use candle_core::{Device, Tensor};
use gradcache::dist::{self, Backend, ReduceOp};
use gradcache::Error;

#[test]
fn nccl_refuses_cleanly_without_a_gpu_or_works_with_one() {
    match dist::init(Backend::Nccl) {
        Err(Error::BackendUnavailable { backend, reason }) => {
            assert_eq!(backend, "nccl");
            assert!(
                reason.contains("GPU") || reason.contains("CUDA"),
                "unclear reason: {reason}"
            );
        }
        Err(other) => panic!("expected BackendUnavailable, got {other}"),
        Ok(comm) => {
            let device = comm.device();
            assert!(matches!(device, Device::Cuda(_)));
            let t = Tensor::new(&[[1f32, 2.0]], &device).unwrap();
            let all = comm.all_gather(&t).unwrap();
            assert_eq!(all.dims(), &[comm.world_size(), 2]);
            let sum = comm.all_reduce(&t, ReduceOp::Sum).unwrap();
            let n = comm.world_size() as f32;
            assert_eq!(sum.to_vec2::<f32>().unwrap(), vec![vec![n, 2.0 * n]]);
        }
    }
}
