//! TFRecord framing of an event file: each record is its length (u64, little-endian), the
//! masked CRC-32C of those 8 bytes, the payload, and the masked CRC-32C of the payload
//! (tensorflow/core/lib/io/record_writer.cc; the mask keeps a CRC of data that holds CRCs
//! from being a CRC of itself).

use std::io::{self, Read, Write};

const MASK_DELTA: u32 = 0xa282_ead8;

pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(MASK_DELTA)
}

pub fn write_record(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = (payload.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc(&len).to_le_bytes())?;
    w.write_all(payload)?;
    w.write_all(&masked_crc(payload).to_le_bytes())
}

/// The next record's payload, `None` at a clean end of file; a short or corrupt record is an
/// error naming what failed.
pub fn read_record(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 8];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut crc = [0u8; 4];
    r.read_exact(&mut crc)?;
    if u32::from_le_bytes(crc) != masked_crc(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "record length fails its CRC",
        ));
    }
    let n = u64::from_le_bytes(len) as usize;
    let mut payload = vec![0u8; n];
    r.read_exact(&mut payload)?;
    r.read_exact(&mut crc)?;
    if u32::from_le_bytes(crc) != masked_crc(&payload) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "record payload fails its CRC",
        ));
    }
    Ok(Some(payload))
}
