//! `.npy` files written atomically: the dataset index cache is written by every rank thread
//! of a process at once (each builds the same entry), so concurrent writes of one path must
//! all succeed and leave a complete file.

use megatron_data::npy::{read_i64, write_i64};

#[test]
fn concurrent_writes_of_one_npy_file_all_succeed_and_leave_it_whole() {
    let dir = std::env::temp_dir().join(format!("megatron-rs-npy-race-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("x-document_index.npy");
    let data: Vec<i64> = (0..50_000).collect();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..20 {
                    write_i64(&path, &[data.len()], &data).unwrap();
                }
            });
        }
    });
    let (shape, back) = read_i64(&path).unwrap();
    assert_eq!(shape, vec![data.len()]);
    assert_eq!(back, data);
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1, "temporary files left behind");
    let _ = std::fs::remove_dir_all(&dir);
}
