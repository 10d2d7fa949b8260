//! GFLOP/s of the CPU backend's f32 GEMMs on MoE-typical shapes.
//!
//! Run: `cargo run --release -p foldmoe-kernels --example gemm_bench`
//!
//! Prints, for `matmul` and `grouped_matmul` through the backend API, the best
//! of a few timed runs; then two measurements behind the constants in
//! `kernels/src/cpu/linalg.rs`: one thread against all threads per product
//! size (the threading threshold), and, for 8 ragged groups, groups in
//! parallel against groups one after another with a threaded GEMM.

use std::time::{Duration, Instant};

use foldmoe_kernels::cpu::Cpu;
use foldmoe_kernels::{Device, HostData, LinalgOps};
use gemm::Parallelism;
use rayon::prelude::*;

/// Deterministic values in [-1, 1): a benchmark needs no real randomness.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Best time of `f` over enough repetitions to fill about `budget`.
fn best_time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f(); // warm caches and the thread pool
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut reps = 0;
    while reps < 3 || (start.elapsed() < budget && reps < 50) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        reps += 1;
    }
    best
}

fn gflops(macs: usize, t: Duration) -> f64 {
    2.0 * macs as f64 / t.as_secs_f64() / 1e9
}

/// `dst = a · b`, row-major, straight through the gemm crate.
fn raw_gemm(dst: &mut [f32], a: &[f32], b: &[f32], m: usize, n: usize, k: usize, par: Parallelism) {
    assert!(dst.len() >= m * n && a.len() >= m * k && b.len() >= k * n);
    // SAFETY: the slices hold the row-major m×k, k×n and m×n matrices (asserted).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cpu = Cpu;
    let threads = rayon::current_num_threads();
    let budget = Duration::from_millis(700);
    println!("foldmoe CPU GEMM benchmark (f32), {threads} rayon threads\n");

    println!("matmul [M, K] · [K, N]");
    for &(m, k, n, what) in &[
        (256, 128, 512, "per-expert slice"),
        (512, 512, 1408, "per-expert slice"),
        (2048, 2048, 2048, "large"),
    ] {
        let a = cpu.upload(HostData::F32(values(m * k, 1)), &[m, k])?;
        let b = cpu.upload(HostData::F32(values(k * n, 2)), &[k, n])?;
        let b_t = cpu.upload(HostData::F32(values(k * n, 2)), &[n, k])?;
        let t = best_time(budget, || {
            cpu.matmul(&a, &b, false, false).expect("matmul");
        });
        let tt = best_time(budget, || {
            cpu.matmul(&a, &b_t, false, true).expect("matmul");
        });
        println!(
            "  M={m:5} K={k:5} N={n:5} ({what:16}) {:8.1} GFLOP/s   (b transposed: {:8.1})",
            gflops(m * n * k, t),
            gflops(m * n * k, tt),
        );
    }

    // 8 experts with uneven loads (one empty), as a dropless router gives.
    let sizes: [i32; 8] = [612, 80, 1024, 0, 350, 700, 198, 1132];
    let m: usize = sizes.iter().map(|&s| s as usize).sum();
    println!("\ngrouped_matmul, 8 ragged groups {sizes:?} (M = {m})");
    for &(k, n) in &[(512, 1408), (1408, 512), (128, 512)] {
        let x = cpu.upload(HostData::F32(values(m * k, 3)), &[m, k])?;
        let w = cpu.upload(HostData::F32(values(8 * k * n, 4)), &[8, k, n])?;
        let gs = cpu.upload(HostData::I32(sizes.to_vec()), &[8])?;
        let t = best_time(budget, || {
            cpu.grouped_matmul(&x, &w, &gs, false)
                .expect("grouped_matmul");
        });
        let dy = cpu.upload(HostData::F32(values(m * n, 5)), &[m, n])?;
        let tw = best_time(budget, || {
            cpu.grouped_matmul_weight_grad(&x, &dy, &gs)
                .expect("weight grad");
        });
        println!(
            "  K={k:5} N={n:5}  forward {:8.1} GFLOP/s   weight grad {:8.1} GFLOP/s",
            gflops(m * n * k, t),
            gflops(m * n * k, tw)
        );
    }

    println!("\nthreading threshold: square products, one thread vs {threads}");
    for &s in &[32usize, 64, 96, 128, 192, 256, 384, 512] {
        let a = values(s * s, 6);
        let b = values(s * s, 7);
        let mut c = vec![0f32; s * s];
        let t1 = best_time(budget / 2, || {
            raw_gemm(&mut c, &a, &b, s, s, s, Parallelism::None)
        });
        let tn = best_time(budget / 2, || {
            raw_gemm(&mut c, &a, &b, s, s, s, Parallelism::Rayon(threads))
        });
        println!(
            "  {s:4}³ = 2^{:4.1} MACs   1 thread {:7.1}   {threads} threads {:7.1} GFLOP/s",
            ((s * s * s) as f64).log2(),
            gflops(s * s * s, t1),
            gflops(s * s * s, tn)
        );
    }

    println!("\ngrouped strategy, K=512 N=1408: groups in parallel vs sequential threaded GEMMs");
    for scale in [1usize, 4, 16] {
        let sz: Vec<usize> = sizes.iter().map(|&s| (s as usize / scale).max(1)).collect();
        let (k, n) = (512, 1408);
        let total: usize = sz.iter().sum();
        let x = values(total * k, 8);
        let w = values(8 * k * n, 9);
        let mut out = vec![0f32; total * n];
        let run = |out: &mut [f32], parallel_groups: bool| {
            let mut parts = Vec::new();
            let mut rest = out;
            let mut off = 0;
            for (g, &s) in sz.iter().enumerate() {
                let (head, tail) = rest.split_at_mut(s * n);
                parts.push((g, off, s, head));
                rest = tail;
                off += s;
            }
            let job = |(g, off, s, dst): (usize, usize, usize, &mut [f32]), par| {
                raw_gemm(
                    dst,
                    &x[off * k..(off + s) * k],
                    &w[g * k * n..],
                    s,
                    n,
                    k,
                    par,
                )
            };
            if parallel_groups {
                parts
                    .into_par_iter()
                    .for_each(|p| job(p, Parallelism::None));
            } else {
                parts
                    .into_iter()
                    .for_each(|p| job(p, Parallelism::Rayon(threads)));
            }
        };
        let tp = best_time(budget, || run(&mut out, true));
        let ts = best_time(budget, || run(&mut out, false));
        println!(
            "  M={total:5} (sizes {sz:?}): parallel groups {:7.1}   sequential threaded {:7.1} GFLOP/s",
            gflops(total * k * n, tp),
            gflops(total * k * n, ts)
        );
    }
    Ok(())
}
