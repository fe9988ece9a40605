//! Probe of kv43's memory pattern (issue 43, `docs/codec.md` session 56): does the decode's
//! read of five arrays in short per-block pieces stream as well as one contiguous array of
//! the same bytes? Per thread, ROWS rows of kv43's bytes for d = 128 (key codes 64 B, value
//! planes 48 B, code sums 4 B per row; value minima and scales 512 B per 64-row block, key
//! minima and scales 512 B per 128 rows), read block by block either from the five arrays
//! (`split`) or from one array holding each block's pieces together (`joined`), each block
//! followed by SPIN dependent multiply-adds standing in for the kernel's arithmetic. The
//! decode's prefetch (four blocks ahead into L2, `ATTNSTORE_KV43_PREFETCH` to change it) is
//! asked for as the decode asks for it. A 1 GB buffer is read before each timed pass, so the
//! pass starts out of cache. Prints ns per row for all threads together.
//!
//! Run: `cargo run --release -p attnstore-kernels --example probe_kv43_stream -- ROWS THREADS SPIN`.

use attnstore_kernels::cpu::kv43::prefetch;
use std::time::Instant;

const BLOCK: usize = 64;
/// Bytes per block of each piece: key codes, code sums, value planes, value minima and
/// scales, and (every other block) key minima and scales.
const PIECES: [usize; 5] = [BLOCK * 64, BLOCK * 4, BLOCK * 48, 512, 512];

/// Where block `b`'s piece `i` lies: `(array, offset)`.
fn place(joined: bool, b: usize, i: usize) -> (usize, usize) {
    let per_block: usize = PIECES[..4].iter().sum();
    if joined {
        // Block pairs: the pair's key metadata, then each block's pieces in reading order.
        let pair = 2 * per_block + PIECES[4];
        let at =
            b / 2 * pair + if i == 4 { 0 } else { PIECES[4] + (b % 2) * per_block + PIECES[..i].iter().sum::<usize>() };
        (0, at)
    } else if i == 4 {
        (4, b / 2 * PIECES[4])
    } else {
        (i, b * PIECES[i])
    }
}

fn wanted(b: usize, i: usize) -> bool {
    i != 4 || b.is_multiple_of(2)
}

/// One pass over `blocks` blocks: sums every byte read, SPIN multiply-adds per block.
fn pass(arrays: &[Vec<u8>], joined: bool, blocks: usize, spin: u64, ahead: usize) -> u64 {
    let mut acc = 0u64;
    for b in 0..blocks {
        if b + ahead < blocks {
            for i in (0..5).filter(|&i| wanted(b + ahead, i)) {
                let (a, at) = place(joined, b + ahead, i);
                prefetch(&arrays[a][at..at + PIECES[i]]);
            }
        }
        for i in (0..5).filter(|&i| wanted(b, i)) {
            let (a, at) = place(joined, b, i);
            let piece = &arrays[a][at..at + PIECES[i]];
            acc = piece.iter().fold(acc, |s, &x| s.wrapping_add(u64::from(x)));
        }
        let mut x = acc | 1;
        for _ in 0..spin {
            x = std::hint::black_box(x.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1));
        }
        acc ^= std::hint::black_box(x);
    }
    acc
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    let rows = args.first().copied().unwrap_or(131_072).div_ceil(2 * BLOCK).max(1) * 2 * BLOCK;
    let threads = args.get(1).copied().unwrap_or(1).max(1);
    let spin = args.get(2).copied().unwrap_or(0) as u64;
    let ahead = std::env::var("ATTNSTORE_KV43_PREFETCH")
        .ok()
        .and_then(|v| v.split(',').next().and_then(|n| n.trim().parse().ok()))
        .unwrap_or(4);
    let blocks = rows / BLOCK;
    let make = |joined: bool| -> Vec<Vec<u8>> {
        let fill = |n: usize| (0..n).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>();
        if joined {
            vec![fill(blocks / 2 * (2 * PIECES[..4].iter().sum::<usize>() + PIECES[4]))]
        } else {
            (0..5).map(|i| fill(if i == 4 { blocks / 2 * PIECES[4] } else { blocks * PIECES[i] })).collect()
        }
    };
    let flush = vec![1u8; 1 << 30];
    println!("{threads} threads × {rows} rows, spin {spin}, prefetch {ahead} blocks ahead: ns per row, all threads");
    for round in 1..=3 {
        let mut line = format!("round {round}:");
        for joined in [false, true] {
            let data: Vec<_> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..threads).map(|_| sc.spawn(move || make(joined))).collect();
                hs.into_iter().map(|h| h.join().expect("allocation")).collect()
            });
            // Evict: read a buffer larger than the last-level cache first.
            std::hint::black_box(flush.iter().fold(0u8, |s, &x| s ^ x));
            let t = Instant::now();
            std::thread::scope(|sc| {
                for arrays in &data {
                    sc.spawn(move || std::hint::black_box(pass(arrays, joined, blocks, spin, ahead)));
                }
            });
            let ns = t.elapsed().as_secs_f64() * 1e9 / (rows * threads) as f64;
            line += &format!(" {} {ns:.2}", if joined { "joined" } else { "split" });
        }
        println!("{line}");
    }
}
