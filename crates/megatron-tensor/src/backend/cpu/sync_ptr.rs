/// A raw pointer that parallel tasks may share because each writes a disjoint region.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not the raw field).
    #[inline]
    pub(crate) fn ptr(&self) -> *mut f32 {
        self.0
    }

    /// # Safety
    /// `[off, off + len)` must be in bounds and written by no other task at the same time.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, off: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }

    /// # Safety
    /// `[off, off + src.len())` must be in bounds and written by no other task at the same time.
    #[inline]
    pub(crate) unsafe fn write(&self, off: usize, src: &[f32]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(off), src.len());
    }
}
